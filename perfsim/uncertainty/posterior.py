"""Conditioning: weight the draws by how well their predictions agree with the observations,
and resample them by weight.

An observation's tolerance is the standard deviation of a normal error around its value: a draw
whose prediction lies z tolerances away gets weight exp(-z^2 / 2) from it, and the product over
the observations. Hard acceptance (keep only draws within every tolerance) leaves a handful of
draws, or one, once there are five observations; the weights keep the posterior smooth.

An observation can be explained with the others when some draw comes within EXPLAINED
tolerances of every one of them. The largest such set (most draws, among sets of equal size) is
what the posterior is conditioned on; each observation outside it is named as what the
profile's ranges cannot explain, with the closest a draw agreeing with the others comes to it.
"""

from __future__ import annotations

import glob
import itertools
import os
from dataclasses import dataclass

import numpy as np

from perfsim.cost.columns import columns_of
from perfsim.uncertainty.observations import load_observations
from perfsim.uncertainty.sampling import DEFAULT_COMM_POINTS, DEFAULT_SAMPLES, Draws, cache_folder, draw, evaluate_draws

# Prior draws conditioning starts from when a profile names observations: several times the
# draws a prediction reports, since only a share of them agrees with the observations.
PRIOR_FACTOR = 4
LEDGER_PRIOR_FACTOR = 32  # where every observation is a ledger's kernels (ledger_observations.py)
EXPLAINED = 2.0  # tolerances: a draw this close to an observation can explain it


@dataclass(frozen=True)
class Posterior:
    prior: Draws
    observations: tuple
    predicted: dict  # observation name -> the quantity per prior draw
    weights: np.ndarray  # per prior draw, summing to 1
    unexplained: tuple  # (observation, closest value among draws agreeing with the others), ...

    @property
    def effective_draws(self) -> float:
        """Kish's effective sample size of the weights."""
        return float(1.0 / np.sum(self.weights ** 2))

    def resampled(self, n: int, seed: int = 0) -> Draws:
        """n draws of the prior taken by weight (systematic resampling: each draw appears about
        n x its weight times)."""
        positions = (np.random.default_rng(seed).uniform() + np.arange(n)) / n
        rows = np.minimum(np.searchsorted(np.cumsum(self.weights), positions), self.prior.n - 1)
        return self.prior.subset(rows)

    def z(self, obs) -> np.ndarray:
        return (self.predicted[obs.name] - obs.value) / obs.tolerance

    def predicted_percentiles(self, obs) -> list:
        """[P10, P50, P90] of the observation's quantity under the posterior (the weighted draws)."""
        return weighted_percentiles(self.predicted[obs.name], self.weights)

    def unexplained_text(self) -> str:
        """One sentence per observation the ranges cannot explain with the others ('' if none)."""
        return " ".join(
            f"cannot explain observation '{obs.name}' ({obs.quantity} {obs.value:g} +- {obs.tolerance:g}) together "
            f"with the others: the closest draw that agrees with them gives {closest:.3g}; conditioned without it."
            for obs, closest in self.unexplained)


def predicted_observations(model_draws: Draws, observations) -> dict:
    """Each observation's quantity under every draw (a plan shared by observations is priced once)."""
    cache: dict = {}
    out = {}
    for obs in observations:
        if hasattr(obs, "predicted_draws"):  # a ledger's kernels (ledger_observations.py): no plan to price
            out[obs.name] = obs.predicted_draws(model_draws)
            continue
        results = []
        for plan in obs.plans():
            key = (obs.model, plan)
            if key not in cache:
                cache[key] = evaluate_draws(obs.model, model_draws, columns_of(plan))
            results.append(cache[key])
        out[obs.name] = obs.predicted(results)
    return out


def condition(prior: Draws, observations) -> Posterior:
    """The draws of `prior` that agree with the largest jointly explainable set of observations."""
    return _posterior(prior, observations, predicted_observations(prior, observations))


def _posterior(prior: Draws, observations, predicted: dict) -> Posterior:
    z = {obs.name: (predicted[obs.name] - obs.value) / obs.tolerance for obs in observations}
    near = {name: np.abs(v) <= EXPLAINED for name, v in z.items()}
    best = None
    for size in range(len(observations), 0, -1):
        for subset in itertools.combinations(observations, size):
            count = np.logical_and.reduce([near[o.name] for o in subset]).sum()
            if count and (best is None or count > best[1]):
                best = (subset, count)
        if best is not None:
            break
    subset = best[0] if best else ()
    agreeing = np.logical_and.reduce([near[o.name] for o in subset] + [np.ones(prior.n, bool)])
    unexplained = tuple((obs, _closest(predicted[obs.name][agreeing], obs.value))
                        for obs in observations if obs not in subset)
    log_weight = -0.5 * sum((z[o.name] ** 2 for o in subset), np.zeros(prior.n))
    weights = np.exp(log_weight - log_weight.max())
    return Posterior(prior, tuple(observations), predicted, weights / weights.sum(), unexplained)


def _closest(values: np.ndarray, target: float) -> float:
    return float(values[np.argmin(np.abs(values - target))])


def profile_draws(system, samples: int = DEFAULT_SAMPLES, seed: int = 0, observe: tuple = ()):
    """The draws a prediction uses: the prior, or where the profile names observations, or
    `observe` names calibration ledgers (ledger_observations.py), the posterior conditioned on
    them (then also the Posterior, else None)."""
    from perfsim.uncertainty.ledger_observations import ledger_observations

    observations = (load_observations(system.observations, system) if system.observations else ()) + tuple(
        obs for path in observe for obs in ledger_observations(path, system))
    if not observations:
        return draw(system, samples, seed), None
    # a ledger's kernels cost little per draw and narrow the draws far more than a published
    # result does: a larger prior keeps more of them effective (the synthetic ledger's test kept 2
    # of 1024, 18 of 8192)
    factor = LEDGER_PRIOR_FACTOR if all(hasattr(o, "predicted_draws") for o in observations) else PRIOR_FACTOR
    prior = draw(system, samples * factor, seed, comm_points=min(samples, DEFAULT_COMM_POINTS) * PRIOR_FACTOR)
    # the loaded observations go into the key with their models' fields: a model file an
    # observation names may change while the profile and observations files stay the same
    posterior = condition_cached(prior, observations, (system.path, system.observations, samples, seed, observations))
    return posterior.resampled(samples, seed), posterior


def condition_cached(prior: Draws, observations, inputs: tuple) -> Posterior:
    """condition(), remembered on disk: the posterior depends only on the profile and observations
    files, the observations as loaded (their models' fields), perfsim's own code and the draw count and seed, and conditioning prices every
    observation's plans under thousands of draws (seconds), while a prediction needs only the
    kept draws. The cache lives in $PERFSIM_CACHE_DIR (default ~/.cache/perfsim); a cache that
    cannot be read or written is recomputed, never an error. `inputs`: (profile path, observations
    path, then anything else the posterior depends on, in the key by its repr)."""
    path = _cache_file(inputs)
    try:
        with np.load(path) as stored:
            predicted = {obs.name: stored[f"predicted:{obs.name}"] for obs in observations}
        if all(v.shape == (prior.n,) for v in predicted.values()):
            return _posterior(prior, observations, predicted)
    except (OSError, KeyError, ValueError):
        pass
    posterior = condition(prior, observations)
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        temporary = f"{path}.{os.getpid()}.npz"
        np.savez(temporary, **{f"predicted:{k}": v for k, v in posterior.predicted.items()})
        os.replace(temporary, path)
    except OSError:
        pass
    return posterior


def _cache_file(inputs: tuple) -> str:
    import hashlib

    digest = hashlib.sha256(repr(inputs[2:]).encode())
    package = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    sources = sorted(glob.glob(os.path.join(package, "**", "*.py"), recursive=True))
    for name in [p for p in inputs[:2] if p] + sources:
        with open(name, "rb") as fh:
            digest.update(fh.read())
    return os.path.join(cache_folder(), f"posterior-{digest.hexdigest()[:32]}.npz")


def weighted_percentiles(values: np.ndarray, weights: np.ndarray, qs=(10, 50, 90)) -> list:
    order = np.argsort(values)
    cumulative = np.cumsum(weights[order])
    return [float(values[order][min(np.searchsorted(cumulative, q / 100), len(values) - 1)]) for q in qs]


def posterior_markdown(posterior: Posterior) -> str:
    """The tables of docs/validation.md: each observation under the prior and the posterior, and
    each uncertain number's (and cause's) P10-P90 before and after conditioning."""
    prior, w = posterior.prior, posterior.weights
    flat = np.full(prior.n, 1 / prior.n)
    out = [f"{prior.n} prior draws, {posterior.effective_draws:.0f} effective after conditioning. "
           + (posterior.unexplained_text() or "Every observation is explained within 2 tolerances."), "",
           "| observation | value +- tolerance | prior P10 / P50 / P90 | posterior P10 / P50 / P90 |", "|---|---|---|---|"]
    for obs in posterior.observations:
        v = posterior.predicted[obs.name]
        out.append(f"| {obs.name} ({obs.quantity}) | {obs.value:g} +- {obs.tolerance:g} | "
                   + " / ".join(f"{x:.3g}" for x in weighted_percentiles(v, flat)) + " | "
                   + " / ".join(f"{x:.3g}" for x in weighted_percentiles(v, w)) + " |")
    out += ["", "| number | prior P10 - P90 | posterior P10 / P50 / P90 |", "|---|---|---|"]
    columns = {key: prior.values[:, j] for j, key in enumerate(prior.keys)} | prior.factors
    for key, v in columns.items():
        p = weighted_percentiles(v, flat)
        q = weighted_percentiles(v, w)
        if abs(q[2] - q[0]) < 0.7 * abs(p[2] - p[0]) or "causes" in key or key.startswith(("node.node_link", "device.gemm_eff")):
            out.append(f"| `{key}` | {p[0]:.3g} - {p[2]:.3g} | {q[0]:.3g} / {q[1]:.3g} / {q[2]:.3g} |")
    out.append("")
    out.append("Numbers whose spread conditioning leaves above 70% of the prior's are not listed.")
    return "\n".join(out)


if __name__ == "__main__":
    from perfsim.spec.system import load_system

    print(posterior_markdown(profile_draws(load_system("smng-p2"))[1]))
