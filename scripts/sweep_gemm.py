"""Tile sizes for the decode GEMMs of kernels/skinny_gemm.py on this GPU, against cuBLAS.

    python scripts/sweep_gemm.py --json OUT.json [--ms 1,16,32,64,128,256] [--limit-s 240]

For each of Qwen3-0.6B's decode GEMMs (qkv, o, gate_up with the SiLU gate fused, down) and each row count M,
times every tile configuration (block_m, block_n, block_k, splits of K) per call in a CUDA graph of
back-to-back calls cycling over weight copies >= 4x the L2 (as scripts/kernel_tables.py times cuBLAS), and
cuBLAS the same way (gate_up: cuBLAS, then the compiled silu_and_mul). Each measurement is appended to
OUT.json.partial.jsonl as it is made; OUT.json holds all rows and the best configuration per (GEMM, M), with
the error of both against a float32 reference. Stops starting new shapes after --limit-s seconds.
"""
import argparse
import itertools
import json
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import kernel_tables as kt  # noqa: E402  (sets up the package's imports and the GPU timer)

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
import triton  # noqa: E402

from nanovllm_edu.kernels.skinny_gemm import skinny_gemm  # noqa: E402
from nanovllm_edu.layers.activation import silu_and_mul  # noqa: E402

SMEM_BYTES = 200 * 1024  # shared memory the pipeline stages may use (the H200 allows 227 KB per block)


def gemm_shapes(shape) -> dict[str, tuple[int, int, bool]]:
    """(output columns N, K, gated) of the four decode GEMMs of a decoder layer (kernel_tables' shapes; gate_up
    with its gate fused writes half its weight's rows)."""
    out = {}
    for name in ("qkv", "o", "gate_up", "down"):
        n, k = kt.decode_gemm_shapes(shape)[name]
        out[name] = (n // 2, k, True) if name == "gate_up" else (n, k, False)
    return out


def configs(m: int, n: int, k: int, gated: bool) -> list[dict]:
    """The tile configurations tried for one GEMM and row count."""
    block_ms = {max(16, min(256, triton.next_power_of_2(m)))} | ({64, 128} if m >= 128 else set())
    block_ns = (16, 32, 64) if n <= 1024 or gated else (32, 64, 128)
    out = []
    for bm, bn, bk, splits in itertools.product(sorted(block_ms), block_ns, (64, 128, 256), (1, 2, 4, 8)):
        if n % bn or k % (splits * bk) or (gated and splits > 1) or (bk == 64 and m < 128):
            continue
        per_stage = (bm * bk + bn * bk * (2 if gated else 1)) * 2
        stages = next((s for s in (5, 4, 3, 2) if s * per_stage <= SMEM_BYTES), None)
        if stages is None:
            continue
        out.append({"block_m": bm, "block_n": bn, "block_k": bk, "splits": splits,
                    "num_warps": 4 if bm * bn <= 64 * 64 else 8, "num_stages": stages})
    return out


def reference_error(x: torch.Tensor, w: torch.Tensor, gated: bool, fn) -> float:
    """Max |fn(x, w) - float32 reference| over the output."""
    ref = x.float() @ w.float().T
    ref = silu_and_mul(ref) if gated else ref
    return (fn(x, w).float() - ref).abs().max().item()


def cublas(gated: bool):
    return (lambda x, w: silu_and_mul(F.linear(x, w))) if gated else F.linear


def precompile(jobs: list[tuple[torch.Tensor, torch.Tensor, bool, dict]]) -> None:
    """Compile every configuration first, in threads (compiling dominates the sweep otherwise)."""
    def one(job):
        x, w, gated, cfg = job
        try:
            skinny_gemm(x, w, gated=gated, **cfg)
        except Exception:  # noqa: BLE001  (reported when timed)
            pass
    with ThreadPoolExecutor(8) as pool:
        list(pool.map(one, jobs))
    torch.cuda.synchronize()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", type=Path, required=True)
    ap.add_argument("--ms", default="1,16,32,64,128,256")
    ap.add_argument("--gemms", default="qkv,o,gate_up,down")
    ap.add_argument("--limit-s", type=float, default=240)
    args = ap.parse_args()
    device = torch.device("cuda")
    timer = kt.GpuTimer(device)
    shape = kt.ModelShape.from_config(json.loads(kt.MODEL_CONFIG.read_text()))
    rates = kt.measure_rates(device, None)
    ms = [int(m) for m in args.ms.split(",")]
    partial = args.json.with_suffix(args.json.suffix + ".partial.jsonl")
    start, rows, best = time.perf_counter(), [], []
    for name in args.gemms.split(","):
        if time.perf_counter() - start > args.limit_s:
            print(f"time limit: {name} not swept", flush=True)
            break
        n, k, gated = gemm_shapes(shape)[name]
        weights = kt.weight_copies(n * (2 if gated else 1), k, device, timer.l2_defeat_bytes)
        xs = {m: torch.randn(m, k, dtype=torch.bfloat16, device=device) for m in ms}
        precompile([(xs[m], weights[0], gated, c) for m in ms for c in configs(m, n, k, gated)])
        for m in ms:
            x = xs[m]

            def timed(fn) -> float:
                return kt.cycled_graph_us(fn, x, weights, timer)

            floor = kt.gemm_floor(m, n * (2 if gated else 1), k, rates)["floor_us"]
            base = {"gemm": name, "M": m, "N": n, "K": k, "gated": gated, "floor_us": floor,
                    "cublas_us": timed(cublas(gated)), "cublas_error": reference_error(x, weights[0], gated, cublas(gated))}
            results = []
            for cfg in configs(m, n, k, gated):
                try:
                    us = timed(lambda a, b: skinny_gemm(a, b, gated=gated, **cfg))
                except Exception as error:  # noqa: BLE001  (a config the compiler rejects: recorded, skipped)
                    us = None
                    print(f"{name} M={m} {cfg}: {type(error).__name__}: {str(error)[:120]}", flush=True)
                row = {**base, **cfg, "us": us}
                results.append(row)
                with partial.open("a") as f:
                    f.write(json.dumps(row) + "\n")
            rows += results
            ok = [r for r in results if r["us"] is not None]
            top = min(ok, key=lambda r: r["us"])
            cfg = {key: top[key] for key in ("block_m", "block_n", "block_k", "splits", "num_warps", "num_stages")}
            top = {**top, "error": reference_error(x, weights[0], gated,
                                                   lambda a, b: skinny_gemm(a, b, gated=gated, **cfg))}
            best.append(top)
            print(f"{name:8s} M={m:4d} floor {floor:6.2f} us  cuBLAS {base['cublas_us']:6.2f}  best {top['us']:6.2f} "
                  f"{cfg}  err {top['error']:.4f} vs cuBLAS {base['cublas_error']:.4f}", flush=True)
        del weights
        torch.cuda.empty_cache()
    record = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
              "copy_bandwidth_GBps": rates.copy_bandwidth / 1e9, "peak_bf16_TFLOPs": rates.peak_flops / 1e12,
              "timing": kt.GEMM_TIMING, "best": best, "rows": rows,
              "seconds": time.perf_counter() - start}
    args.json.write_text(json.dumps(record, indent=1) + "\n")
    print(f"wrote {args.json} in {record['seconds']:.0f} s")


if __name__ == "__main__":
    main()
