"""The harness runs wherever torch runs (issue 29): no module under validate/ reaches for a device's
own torch module (torch.cuda, torch.xpu, tensor.cuda(), an import of either) outside
validate/device.py, whose Device is the one interface to them; the exceptions say why."""

from __future__ import annotations

import ast
import os

VALIDATE = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "validate")
DEVICE_MODULES = ("cuda", "xpu")
# (module, what it names) -> why it may
JUSTIFIED = {
    ("device_consistency.py", "torch.Tensor.cuda"): "it intercepts moves to a GPU, to clear a host mark",
    ("device_consistency.py", "torch.Tensor.xpu"): "it intercepts moves to a GPU, to clear a host mark",
}


def device_specific(tree) -> list:
    """What a module's syntax names of a device's own API: `x.cuda` / `x.xpu` attributes,
    getattr(x, "cuda"), and imports of torch.cuda / torch.xpu."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and node.attr in DEVICE_MODULES:
            found.append(ast.unparse(node))
        elif isinstance(node, ast.Call) and getattr(node.func, "id", None) == "getattr" and len(node.args) > 1 \
                and isinstance(node.args[1], ast.Constant) and node.args[1].value in DEVICE_MODULES:
            found.append(ast.unparse(node))
        elif isinstance(node, ast.ImportFrom) and node.module and (
                node.module.split(".")[:2] in (["torch", m] for m in DEVICE_MODULES)
                or node.module == "torch" and any(a.name in DEVICE_MODULES for a in node.names)):
            found.append(ast.unparse(node))
        elif isinstance(node, ast.Import):
            found += [f"import {a.name}" for a in node.names
                      if a.name.split(".")[:2] in (["torch", m] for m in DEVICE_MODULES)]
    return found


def test_device_specific_calls_stay_in_validate_device():
    unjustified = []
    for name in sorted(os.listdir(VALIDATE)):
        if not name.endswith(".py") or name == "device.py":
            continue
        with open(os.path.join(VALIDATE, name)) as fh:
            tree = ast.parse(fh.read())
        unjustified += [f"{name}: {what}" for what in device_specific(tree) if (name, what) not in JUSTIFIED]
    assert unjustified == [], "use validate.device.Device (or justify it in JUSTIFIED)"


def test_the_finder_finds_each_form():
    code = ("import torch\nimport torch.cuda\nfrom torch.xpu import Event\nfrom torch import cuda\n"
            "torch.cuda.synchronize()\nx.cuda()\ngetattr(torch, 'xpu')\ntorch.version.cuda\n")
    assert sorted(device_specific(ast.parse(code))) == sorted([
        "import torch.cuda", "from torch.xpu import Event", "from torch import cuda", "torch.cuda", "x.cuda",
        "getattr(torch, 'xpu')", "torch.version.cuda"])
