"""Correctness and exactness of real 1D tensor-parallel training steps (validate.gpt), per rank.

Run as ranks (`python -m validate.tp_check OUT.json --model SPEC --mbs B`, launched by
validate.launcher.launch_ranks). For every case (1d and 1d+SP, recompute none/selective/full)
each rank builds the same seeded model, keeps an unsharded copy as the single-process reference,
shards the other, runs one forward and backward on the same batch and records:

- loss and gradients against the reference (gradients gathered to full tensors);
- matrix FLOPs it ran (validate.instrument.LocalFlopCounter) against perfsim's GEMMs for the plan
  (perfsim.cost.tensor_parallel.layer_gemms / head_gemm, recomputation as perfsim.cost.counts
  defines it);
- bytes each collective kind sends (validate.instrument.CollectiveCounter, ring convention)
  against perfsim.cost.tensor_parallel.collectives_sent_bytes over the embedding, layer and head
  collectives. The run is fp32 (CPU); perfsim prices activations in bf16, so counted activation
  collectives are re-priced at 2 bytes an element; the loss statistics ([tokens] each) are fp32 in
  both. Gradient synchronisation of replicated parameters is not a TP activation collective
  (perfsim does not model it) and is reported separately;
- parameter elements it holds against perfsim.cost.memory.stage_params (perfsim's weight bytes
  are 2 x that in bf16; this fp32 run holds 4 x).

Rank 0 writes one JSON object: {"world": P, "cases": [{case..., "ranks": [per-rank dicts]}]}.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses

from perfsim.cost import tensor_parallel as tpc
from perfsim.cost.columns import columns_of
from perfsim.cost.context_parallel import kv_block_bytes
from perfsim.cost.counts import ATTENTION_CORE
from perfsim.cost.layer import BF16, FP32
from perfsim.cost.memory import layout_activation_bytes, memory_breakdown, ring_saved_bytes, stage_params
from perfsim.spec.model import load_model
from perfsim.spec.plan import Plan
from perfsim.spec.system import load_system

CASES = [(sp, rc) for sp in (False, True) for rc in ("none", "selective", "full")]
# bf16 parameters (Megatron's regime; on CPU without autocast): checked against the fp32 reference
BF16_CASES = [(False, "selective"), (True, "full")]
ATTENTION = ("unfused", "flash")  # "all" runs the unfused cases; a flash case runs when named


def case_name(sp: bool, recompute: str, bf16: bool = False, attention: str = "unfused") -> str:
    return f"1d{'+sp' if sp else ''}-{recompute}{'-bf16' if bf16 else ''}{'-flash' if attention == 'flash' else ''}"


def named_cases(cases: str) -> list:
    """(sp, recompute, bf16, attention) of each case `cases` names ("all": CASES and BF16_CASES,
    unfused), in the order they run."""
    every = [(sp, rc, bf16, att) for att in ATTENTION for bf16 in (False, True) for sp, rc in CASES]
    if cases == "all":
        return [c + (False, "unfused") for c in CASES] + [c + (True, "unfused") for c in BF16_CASES]
    by_name = {case_name(*c): c for c in every}
    unknown = [n for n in cases.split(",") if n not in by_name]
    if unknown:
        raise ValueError(f"unknown case {unknown[0]!r}; cases are named like {case_name(True, 'full', True, 'flash')}")
    return [c for c in every if case_name(*c) in cases.split(",")]


def gemm_flops(g) -> float:
    return 2 * g.count * g.m * g.n * g.k


@dataclasses.dataclass
class PerfsimStep:
    """What perfsim says one tensor-parallel rank does in one forward + backward of one
    micro-batch with pp = 1 (shared by tp_check and multidim_check)."""

    columns: object
    layout: object
    flops: float  # matrix FLOPs: layers and head x 3, plus what recomputation repeats
    layer: list  # one layer's collectives: forward, backward, the forward again under full recomputation
    embedding: list  # forward + backward
    head: list  # forward + backward (final norm, logits, loss)
    params: float  # stage_params of the single stage


def perfsim_step(model, plan: Plan) -> PerfsimStep:
    c = columns_of(plan)
    layout = tpc.layout_of(model, c)
    b, vocab = plan.mbs, model.padded_vocab(plan.tp)
    gemms = tpc.layer_gemms(layout, model, b)
    layer = sum(gemm_flops(g) for g in gemms)
    head = gemm_flops(tpc.head_gemm(layout, model, b, vocab))
    recompute = {"none": 0, "full": layer, "selective": sum(gemm_flops(g) for g in gemms if g.name in ATTENTION_CORE)}
    flops = 3 * (model.layers * layer + head) + model.layers * recompute[plan.recompute]
    if plan.attention == "flash":  # the fused backward recomputes the scores (docs/equations.md 3.9)
        flops += model.layers * sum(gemm_flops(g) for g in gemms if g.name == ATTENTION_CORE[0])
    from perfsim.cost.traffic import tp_collectives

    _, layer_colls, _ = tp_collectives(model, plan)
    e_fwd, e_bwd = tpc.embedding_collectives(layout, model, b)
    h_fwd, h_bwd = tpc.head_collectives(layout, model, b, vocab)
    return PerfsimStep(c, layout, float(flops), layer_colls, e_fwd + e_bwd, h_fwd + h_bwd,
                       float(stage_params(model, c, "first")))


def perfsim_expected(model, plan: Plan) -> dict:
    """What perfsim says one rank does in one forward + backward of one micro-batch."""
    step = perfsim_step(model, plan)
    per_kind = {}
    for kind in (tpc.ALL_REDUCE, tpc.ALL_GATHER, tpc.REDUCE_SCATTER):
        pick = [x for x in step.layer if x.kind == kind]
        edge = [x for x in step.embedding + step.head if x.kind == kind]
        per_kind[kind] = float(model.layers * tpc.collectives_sent_bytes(step.layout, pick)
                               + tpc.collectives_sent_bytes(step.layout, edge))
    return {"flops": step.flops, "sent_bytes": per_kind, "params": step.params}


def perfsim_saved_bytes(model, plan: Plan) -> dict:
    """perfsim's activation bytes for the plan (one micro-batch, one stage) and the like-for-like
    figure a saved-tensor count is compared with (docs/real-steps.md, "Saved activations").

    From perfsim: `layer` = layout_activation_bytes per layer; `edge` = what memory_breakdown adds
    for the embedding and head, i.e. its activations minus the layers and minus the full-recompute
    working set (a peak during backward, not saved by the forward). Conventions the real step
    differs in, each a named term: torch's SP keeps the all-gathered QKV and FC1 inputs for the
    weight gradients (Megatron keeps the shard and all-gathers again in backward, which perfsim's
    memory assumes). Under context parallelism without recomputation, validate.gpt's multi-head
    attention hands the ring Q as a view of the QKV output, which keeps the rank's own K and V
    alive with it (Megatron gives the ring a Q of its own, as the Llama-shaped layers do: TE makes
    it contiguous). (perfsim's head term once also held the bf16 logits, which the cross-entropy
    does not save; the saved-tensor counts here showed it, and perfsim now counts them as a
    one-micro-batch buffer.)"""
    if model.dropout:
        raise ValueError("validate.gpt has no dropout: give the model spec dropout=false")
    c = columns_of(plan)
    layout = tpc.layout_of(model, c)
    # a context-parallel rank holds s/cp tokens of each sequence: mbs/cp sequences' worth
    b, t = plan.mbs / getattr(plan, "cp", 1), plan.tp
    tokens = b * model.seq
    layer = float(layout_activation_bytes(model, layout, b, c.recompute, c.flash) + ring_saved_bytes(model, c))
    # any profile: activation bytes do not depend on the machine
    activations = float(memory_breakdown(model, load_system("cpu-example"), c, last_stage=True)["activations"])
    working = float(layout_activation_bytes(model, layout, b, 0, c.flash)) if plan.recompute == "full" else 0.0
    working += float(ring_saved_bytes(model, c, kept=False))  # the ring's block, rebuilt by recomputation
    edge = activations - model.layers * layer - working
    gathered = 2 * BF16 * tokens * model.hidden * (1 - 1 / t) if plan.sp and plan.recompute != "full" else 0.0
    qkv_view = model.kv_head_count == model.heads and model.learned_positions  # validate.gpt.Attention
    qkv_view = qkv_view and c.cp > 1 and plan.recompute == "none"
    own_kv = float(kv_block_bytes(model, plan.mbs, c.cp, t)) if qkv_view else 0.0
    layer_like = layer + gathered + own_kv
    return {"layer": layer, "layers": model.layers * layer, "edge": edge, "working_set": working,
            "activations": activations, "sp_gathered_inputs_per_layer": gathered, "ring_own_kv_per_layer": own_kv,
            "layer_like": layer_like, "edge_like": edge, "like": model.layers * layer_like + edge}


# Prices of saved tensors (bytes an element); floating tensors at perfsim's activation dtype.
PRICE_ACTIVATION = BF16  # activations and norm statistics (this run is fp32; perfsim prices bf16)
PRICE_LOSS = FP32  # the cross-entropy's log-probabilities: fp32 in perfsim (and under autocast)
PRICE_MASK = 1  # bool, as perfsim prices dropout masks


def price_saved(items, fp32_shapes=()) -> dict:
    """Bytes by region and kind at perfsim's prices. Kinds: "activation" (floating, modelled by
    perfsim), "norm_stats" (LayerNorm mean and 1/std, [..., 1]), "mask" (bool), "index" (integer:
    token ids, targets; their own size), "scalar" (0-dim, their own size); the last four are
    not in perfsim's model. Floating tensors of a shape in `fp32_shapes` are activations priced
    at 4 bytes: a fused attention's log-sum-exp ([b, heads, s]), fp32 in every dtype, as perfsim
    prices it."""
    fp32_shapes = [list(x) for x in fp32_shapes]
    by_region, by_kind = {}, {}
    for it in items:
        dtype, shape, n = it["dtype"], it["shape"], it["storage_elements"]
        if not shape:
            kind, price = "scalar", it["storage_bytes"] / n
        elif dtype == "bool":
            kind, price = "mask", PRICE_MASK
        elif not dtype.startswith(("float", "bfloat")):
            kind, price = "index", it["storage_bytes"] / n
        elif shape[-1] == 1:
            kind, price = "norm_stats", PRICE_ACTIVATION
        else:
            fp32 = it["region"] == "loss" or shape in fp32_shapes
            kind, price = "activation", PRICE_LOSS if fp32 else PRICE_ACTIVATION
        region = by_region.setdefault(it["region"], {})
        region[kind] = region.get(kind, 0.0) + n * price
        by_kind[kind] = by_kind.get(kind, 0.0) + n * price
    return {"by_region": by_region, "by_kind": by_kind, "total": sum(by_kind.values()),
            "as_run": float(sum(it["storage_bytes"] for it in items))}


def counted_sent_bytes(records, tokens: int, hidden: int) -> tuple[dict, dict]:
    """(activation and loss collectives by kind at perfsim's prices, everything else by kind)."""
    from validate.instrument import Record

    activations, other = {}, {}
    for r in records:
        if r.elements == tokens and r.kind == "all_reduce":  # loss statistics: fp32 in perfsim too
            priced, into = Record(r.kind, r.elements, FP32, r.group_size), activations
        elif r.elements % (tokens * hidden) == 0:
            priced, into = Record(r.kind, r.elements, BF16, r.group_size), activations
        else:
            priced, into = r, other
        into[r.kind] = into.get(r.kind, 0.0) + priced.sent_bytes()
    return activations, other


class SavedTensorCounter:
    """What a forward saves for backward, each storage once, parameters excluded, by region.

    Entered around the forward: torch.autograd.graph.saved_tensors_hooks sees every tensor an
    autograd node saves (DTensors are counted by their local shard), and
    validate.gpt.observe_checkpoint_inputs the inputs a checkpointed region keeps for its
    recomputation (held in a closure, invisible to the hooks; inside the region the checkpoint's
    own hooks replace ours, so what it discards is not counted). Forward pre-hooks label the
    region: "embedding", "layer<i>", "head" (final norm and logits GEMM), "loss" (after the head)."""

    def __init__(self, torch, model):
        self.torch = torch
        self.model = model
        self.params = {self._key(p) for p in model.parameters()}
        self.region = "embedding"
        self.items = []
        self._seen = set()
        self._alive = []  # keeps counted storages alive so no address is reused while counting

    @staticmethod
    def _local(t):
        """A DTensor's shard on this rank, a functional collective's result (a wrapper) its tensor."""
        from validate.instrument import storage_of

        return storage_of(t)[0]

    def _key(self, t):
        st = self._local(t).untyped_storage()
        return st.data_ptr(), st.nbytes()

    def _record(self, t):
        local = self._local(t)
        key = self._key(t)
        if key in self.params or key in self._seen or key[1] == 0:
            return
        self._seen.add(key)
        self._alive.append(local)
        self.items.append({"region": self.region, "dtype": str(local.dtype).replace("torch.", ""),
                           "shape": list(local.shape), "storage_elements": key[1] // local.element_size(),
                           "storage_bytes": key[1]})

    def _pack(self, t):
        self._record(t)
        return t

    def _label(self, name):
        def hook(module, args):
            self.region = name
        return hook

    def __enter__(self):
        from validate.gpt import observe_checkpoint_inputs

        torch, m = self.torch, self.model
        self._handles = [m.embed.register_forward_pre_hook(self._label("embedding")),
                         m.ln_f.register_forward_pre_hook(self._label("head")),
                         m.head.register_forward_hook(lambda *a: setattr(self, "region", "loss"))]
        self._handles += [b.register_forward_pre_hook(self._label(f"layer{i}")) for i, b in enumerate(m.blocks)]
        self._stack = contextlib.ExitStack()
        self._stack.enter_context(torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t))
        self._stack.enter_context(observe_checkpoint_inputs(self._record))
        return self

    def __exit__(self, *exc):
        self._stack.close()
        for h in self._handles:
            h.remove()
        self._alive = []
        return False


def run_case(torch, mesh, model, sp: bool, recompute: str, mbs: int, bf16: bool = False,
             attention: str = "unfused") -> dict:
    from validate.gpt import GPT, GPTConfig, local_parameter_elements, parallelize
    from validate.instrument import CollectiveCounter, LocalFlopCounter

    tp = mesh.size()
    cfg = GPTConfig.from_spec(model, tp, recompute, attention)
    torch.manual_seed(0)
    reference = GPT(cfg)
    parallel = parallelize(copy.deepcopy(reference).to(torch.bfloat16 if bf16 else torch.float32), mesh, sp)
    gen = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, model.vocab, (mbs, cfg.seq), generator=gen)
    targets = torch.randint(0, model.vocab, (mbs, cfg.seq), generator=gen)

    ref_loss = reference.loss(tokens, targets)
    reference.backward(ref_loss)

    flops, collectives = LocalFlopCounter(), CollectiveCounter()
    saved = SavedTensorCounter(torch, parallel)
    with flops, collectives:
        with saved:
            loss = parallel.loss(tokens, targets)
        parallel.backward(loss)
    finish = CollectiveCounter()
    with finish:
        parallel.finish_gradients()

    grad_err, grad_scale, partial = 0.0, 0.0, []
    ref_params = dict(reference.named_parameters())
    for name, p in parallel.named_parameters():
        g = p.grad
        if hasattr(g, "full_tensor"):
            if any(pl.is_partial() for pl in g.placements):
                partial.append(name)
            g = g.full_tensor()
        grad_err = max(grad_err, float((g.float() - ref_params[name].grad).abs().max()))
        grad_scale = max(grad_scale, float(ref_params[name].grad.abs().max()))
    loss_value = float((loss.full_tensor() if hasattr(loss, "full_tensor") else loss).detach().float())

    plan = Plan(tp=tp, sp=sp, mbs=mbs, gbs=mbs, recompute=recompute, attention=attention)
    expected = perfsim_expected(model, plan)
    activation_bytes, other_bytes = counted_sent_bytes(collectives.records, mbs * model.seq, model.hidden)
    return {
        "dtype": "bf16" if bf16 else "fp32", "loss": loss_value, "reference_loss": float(ref_loss.detach()), "grad_max_abs_error": grad_err,
        "grad_max_abs": grad_scale, "partial_grads": partial,
        "flops": {"counted": flops.total(), "perfsim": expected["flops"], "by_op": flops.by_op()},
        "sent_bytes": {"counted": activation_bytes, "perfsim": expected["sent_bytes"],
                       "other_in_step": other_bytes, "gradient_sync": finish.by_kind(),
                       "as_asked_fp32": collectives.by_kind(), "gloo_wire_fp32": collectives.gloo_wire_by_kind()},
        "params": {"counted": local_parameter_elements(parallel), "perfsim": expected["params"]},
        # a fused kernel's log-sum-exp, [b, heads / t, s], is fp32 in every dtype (as perfsim prices it)
        "saved_bytes": {"counted": price_saved(saved.items, [(mbs, model.heads // tp, model.seq)] * (attention == "flash")),
                        "perfsim": perfsim_saved_bytes(model, plan), "items": saved.items},
    }


def main(argv=None) -> int:
    from validate.ranks import check_parser, every_rank, gloo_ranks, write_on_rank0

    parser = check_parser("python -m validate.tp_check",
                          "layers=2,hidden=64,heads=4,seq=32,vocab=128,tied_embeddings=false,dropout=false",
                          "comma list of 1d-none, 1d+sp-full, 1d-selective-bf16-flash ... or all (the unfused ones)")
    parser.add_argument("--mbs", type=int, default=2)
    args = parser.parse_args(argv)

    import torch
    from torch.distributed.device_mesh import init_device_mesh

    with gloo_ranks(args.timeout) as ranks:
        mesh = init_device_mesh("cpu", (ranks.world,), mesh_dim_names=("tp",))
        model = load_model(args.model)
        results = []
        for sp, rc, bf16, attention in named_cases(args.cases):
            everyone = every_rank(run_case(torch, mesh, model, sp, rc, args.mbs, bf16, attention))
            results.append({"case": case_name(sp, rc, bf16, attention), "sp": sp, "recompute": rc, "bf16": bf16,
                            "attention": attention, "ranks": everyone})
        write_on_rank0(ranks, args.out, model=args.model, mbs=args.mbs, cases=results)
    return 0


if __name__ == "__main__":
    from validate.ranks import leave

    leave(main())
