"""`perfsim profiles`: the system profiles in hwprofiles/ and the model presets."""

from __future__ import annotations

import json


def register(sub) -> None:
    p = sub.add_parser("profiles", help="list system profiles and model presets")
    p.add_argument("--json", action="store_true")
    p.set_defaults(run=run)


def run(args) -> None:
    from perfsim.cost.counts import total_params
    from perfsim.spec.model import load_model
    from perfsim.spec.presets import PRESETS
    from perfsim.spec.system import available_systems, load_system

    systems = [load_system(name) for name in available_systems()]
    models = [load_model(name) for name in PRESETS]
    if args.json:
        print(json.dumps({"systems": [{"name": s.name, "description": s.description, "path": s.path} for s in systems],
                          "models": [m.as_dict() | {"params": total_params(m)} for m in models]}, indent=2))
        return
    print("systems (--system NAME, or a path to a .toml profile)")
    for s in systems:
        print(f"  {s.name:<14} {s.node.devices_per_node} x {s.device.name}, "
              f"{s.device.peak_flops_bf16 / 1e12:.1f} TFLOP/s bf16 peak  - {s.description}")
    print("\nmodels (--model NAME, key=value pairs, or a .toml file)")
    for m in models:
        print(f"  {m.name:<14} {total_params(m) / 1e9:8.2f} B params  layers {m.layers:<4} hidden {m.hidden:<6} "
              f"heads {m.heads:<4} seq {m.seq}")
