"""The decode step's layers without attention, as CUDA graphs of 28 layers, with and without programmatic
dependent launch (PDL): what the gaps between kernels cost, and what overlapping them buys.

    python scripts/profile_pdl.py --json OUT.json [--ms 1,2,4,...,256] [--layers 28] [--rounds 5]
    python scripts/profile_pdl.py --json OUT.json --smoke   # CPU check: 1 layer, M = 1 and 3, no graphs

Per layer, as the engine runs a decode step of M rows (Qwen3-0.6B's shapes, random weights, one copy per
layer so nothing stays in L2): add+RMSNorm, the qkv GEMM, QK-norm+RoPE, the KV store, the o GEMM (on the
rotated queries: attention itself is left out, it is timed by scripts/sweep_attention.py), add+RMSNorm, the
fused gate (gate_up GEMM with SiLU), the down GEMM. Variants:

    today   compiled norms (torch.compile), cuBLAS for qkv/o/down, the fused gate (notebook 16)
    triton  every norm and GEMM a Triton kernel of ours (kernels/pdl_chain.py's norm; GEMM tiles: the fastest
            unsplit ones of the GEMM sweep, as PLAIN_TILES holds them)
    pdl     triton, launched with PDL: each kernel starts early, waits for the previous one, lets the next start

The engine runs `pdl` up to PDL_MAX_ROWS rows and `today` above. Each variant's layers are one CUDA graph;
rounds alternate the variants (the machine is noisy) and the median replay is reported per layer. Outputs are
compared with `today` (max abs difference) and with `triton` (PDL must not change a bit).
"""
import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import kernel_tables as kt  # noqa: E402  (sets up the package's imports)

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from nanovllm_edu.kernels.qk_norm_rope import qk_norm_rope  # noqa: E402
from nanovllm_edu.kernels.pdl_chain import PDL_MAX_ROWS, rms_norm_triton  # noqa: E402
from nanovllm_edu.kernels.skinny_gemm import skinny_gemm, triton_gate_up  # noqa: E402
from nanovllm_edu.kernels.store_kvcache import get_store_kvcache  # noqa: E402
from nanovllm_edu.utils.device import triton_interpreted  # noqa: E402
from nanovllm_edu.layers.activation import silu_and_mul  # noqa: E402
from nanovllm_edu.layers.layernorm import add_rms_norm  # noqa: E402
from nanovllm_edu.layers.rotary_embedding import RotaryEmbedding  # noqa: E402

VARIANTS = ("today", "triton", "pdl")
MS = "1,2,4,8,16,24,32,48,64,96,128,192,256"
SWEEP = Path(__file__).resolve().parent.parent / "figures" / "sweep_gemm_h200.json"
EPS = 1e-6


def plain_tiles(sweep: dict) -> dict[tuple[str, int], dict]:
    """(gemm, M) -> the fastest unsplit tile configuration of the GEMM sweep (PDL chains have no split sum)."""
    best = {}
    for row in sweep["rows"]:
        if row.get("gated") or row.get("splits", 1) != 1 or row.get("us") is None:
            continue
        key = (row["gemm"], row["M"])
        if key not in best or row["us"] < best[key]["us"]:
            best[key] = row
    return best


def tiles_for(tiles: dict, gemm: str, m: int) -> dict:
    ms = sorted(mm for g, mm in tiles if g == gemm)
    row = tiles[(gemm, next((mm for mm in ms if mm >= m), ms[-1]))]
    return {k: row[k] for k in ("block_m", "block_n", "block_k", "num_warps", "num_stages")}


def make_layers(num_layers: int, shape, device: torch.device, dtype: torch.dtype) -> list[dict]:
    h, d = shape.hidden, shape.head_dim
    q_size, kv_size, inter = shape.num_heads * d, shape.num_kv_heads * d, shape.intermediate
    gen = torch.Generator(device=device).manual_seed(kt.SEED)

    def weight(*size):
        return (torch.randn(*size, device=device, generator=gen) / size[-1] ** 0.5).to(dtype)

    def gain(n):
        return (1 + 0.1 * torch.randn(n, device=device, generator=gen)).to(dtype)

    return [{"qkv": weight(q_size + 2 * kv_size, h), "o": weight(h, q_size), "gate_up": weight(2 * inter, h),
             "down": weight(h, inter), "in_norm": gain(h), "post_norm": gain(h), "q_norm": gain(d),
             "k_norm": gain(d)} for _ in range(num_layers)]


def chain(variant: str, layers: list[dict], x: torch.Tensor, residual: torch.Tensor, positions: torch.Tensor,
          caches: tuple[torch.Tensor, torch.Tensor], slots: torch.Tensor, rope: RotaryEmbedding, shape,
          tiles: dict) -> torch.Tensor:
    """The layers of one decode step (no attention) for `variant`; returns the last hidden states."""
    m, d = x.shape[0], shape.head_dim
    q_size, kv_size = shape.num_heads * d, shape.num_kv_heads * d
    pdl = variant == "pdl"
    store = get_store_kvcache(x.device)

    def norm(h, res, w):
        if variant == "today":
            return add_rms_norm(h, res, w, EPS)
        return rms_norm_triton(h, w, EPS, residual=res, pdl=pdl)

    def gemm(h, w, name):
        if variant == "today":
            return F.linear(h, w)
        return skinny_gemm(h, w, pdl=pdl, **tiles_for(tiles, name, m))

    for layer in layers:
        h, residual = norm(x, residual, layer["in_norm"])
        q, k, v = gemm(h, layer["qkv"], "qkv").split([q_size, kv_size, kv_size], dim=-1)
        q, k = qk_norm_rope(positions, q.view(m, -1, d), k.view(m, -1, d), layer["q_norm"], layer["k_norm"],
                            EPS, EPS, rope.cos_sin_cache)
        store(k, v.view(m, -1, d), *caches, slots)
        h, residual = norm(gemm(q.view(m, -1), layer["o"], "o"), residual, layer["post_norm"])
        if h.is_cuda and not triton_interpreted():  # the fused gate, as the engine's TritonGateUp runs it
            gated = triton_gate_up(h, layer["gate_up"], pdl)
        else:  # on a CPU, as the engine's MLP runs there (notebook 02's GateUp)
            gated = silu_and_mul(F.linear(h, layer["gate_up"]))
        x = gemm(gated, layer["down"], "down")
    return x


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", required=True)
    parser.add_argument("--ms", default=MS)
    parser.add_argument("--layers", type=int, default=28)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--smoke", action="store_true", help="CPU check: 1 layer, M = 1 and 3, one round")
    args = parser.parse_args()
    start = time.perf_counter()
    on_gpu = torch.cuda.is_available() and not args.smoke
    device = torch.device("cuda" if on_gpu else "cpu")
    shape = kt.ModelShape.from_config(json.loads(kt.MODEL_CONFIG.read_text()))
    ms = [1, 3] if args.smoke else [int(m) for m in args.ms.split(",")]
    num_layers, rounds = (1, 1) if args.smoke else (args.layers, args.rounds)
    variants = ("today", "triton") if not on_gpu else VARIANTS  # PDL needs a Hopper GPU
    dtype = torch.bfloat16
    tiles = plain_tiles(json.loads(SWEEP.read_text()))
    layers = make_layers(num_layers, shape, device, dtype)
    rope = RotaryEmbedding(shape.head_dim, 4096, 1e6).to(device)
    caches = tuple(torch.zeros(max(ms) * 2, 16, shape.num_kv_heads, shape.head_dim, device=device, dtype=dtype)
                   for _ in range(2))
    rows = []
    for m in ms:
        gen = torch.Generator(device=device).manual_seed(m)
        x = torch.randn(m, shape.hidden, device=device, generator=gen).to(dtype)
        residual = torch.randn(m, shape.hidden, device=device, generator=gen).to(dtype)
        positions = torch.randint(0, 4096, (m,), device=device, generator=gen)
        slots = torch.arange(m, device=device) * 16

        def run(variant):
            return chain(variant, layers, x, residual, positions, caches, slots, rope, shape, tiles)

        outs = {v: run(v).float() for v in variants}
        row = {"M": m, "max_abs_diff_vs_today": {v: float((outs[v] - outs["today"]).abs().max()) for v in variants},
               "bit_identical_to_triton": {v: bool(torch.equal(outs[v], outs["triton"])) for v in variants}}
        if on_gpu:
            graphs = {v: kt.capture_graph(lambda v=v: run(v)) for v in variants}
            times = {v: [] for v in variants}
            for _ in range(rounds):
                for v in variants:
                    graph = graphs[v]
                    graph.replay()
                    begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                    begin.record()
                    for _ in range(10):
                        graph.replay()
                    end.record()
                    torch.cuda.synchronize()
                    times[v].append(begin.elapsed_time(end) * 1e3 / 10 / num_layers)
            row["us_per_layer"] = {v: round(statistics.median(t), 2) for v, t in times.items()}
            row["us_per_layer_runs"] = {v: [round(t, 2) for t in ts] for v, ts in times.items()}
        rows.append(row)
        print(json.dumps(row), flush=True)
    record = {"device": torch.cuda.get_device_name() if on_gpu else "cpu", "torch": torch.__version__,
              "triton": __import__("triton").__version__, "layers": num_layers, "rounds": rounds,
              "kernels_per_layer": 8, "variants": list(variants), "pdl_max_rows": PDL_MAX_ROWS, "rows": rows,
              "seconds": round(time.perf_counter() - start, 1), "command": " ".join(sys.argv)}
    Path(args.json).write_text(json.dumps(record, indent=1) + "\n")


if __name__ == "__main__":
    main()
