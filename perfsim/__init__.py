"""perfsim: predict, explain and check the performance of LLM training plans on HPC systems.

    >>> import perfsim
    >>> result = perfsim.predict("gpt3-175b", "smng-p2", perfsim.Plan(tp=8, pp=16, mbs=3, gbs=300, zero=1, recompute="full"))
"""

from perfsim.errors import PerfsimError
from perfsim.predict import Prediction, predict
from perfsim.spec.model import ModelSpec, load_model
from perfsim.spec.plan import Plan, plan_problems
from perfsim.spec.system import System, load_system

__version__ = "0.1.0"
__all__ = ["PerfsimError", "Prediction", "predict", "ModelSpec", "load_model", "Plan", "plan_problems",
           "System", "load_system", "__version__"]
