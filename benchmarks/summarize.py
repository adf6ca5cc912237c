"""Summary tables for docs/BENCHMARKS.md from the bench JSON files: per torch_fused row, the
fastest other implementation of the same group and shape in the same run.
python benchmarks/summarize.py [benchmarks/results]"""

import json
import sys
from pathlib import Path


def logprobs_table(rows):
    out = ["| op (bf16) | shape | torch_fused ms | fraction of floor | best baseline (same run) | its ms | speed-up | "
           "torch_fused peak extra MiB |", "|---|---|---:|---:|---|---:|---:|---:|"]
    for r in rows:
        if r["impl"] != "torch_fused":
            continue
        others = [o for o in rows if o["group"] == r["group"] and o["shape"] == r["shape"] and o["impl"] != "torch_fused"]
        best = min(others, key=lambda o: o["ms"]) if others else None
        pk = "" if r["peak_extra_mb"] is None else f"{r['peak_extra_mb']:.0f}"
        out.append(f"| {r['group']} | {r['shape']} | {r['ms']:.3f} | **{r['frac_floor']:.3f}** | "
                   + (f"{best['impl']} | {best['ms']:.3f} | {best['ms'] / r['ms']:.2f}x" if best else "| |")
                   + f" | {pk} |")
    return "\n".join(out)


def mask_reduce_table(rows):
    out = ["| mask_reduce (bf16 x, bool mask, reduce dim 1) | torch_fused ms | fraction of floor | torch.compile ms | "
           "its fraction | eager ms | torch_fused peak extra MiB |", "|---|---:|---:|---:|---:|---:|---:|"]
    for shape in dict.fromkeys(r["shape"] for r in rows):
        by = {r["impl"]: r for r in rows if r["shape"] == shape}
        f, c, e = by["torch_fused"], by["torch.compile where"], by["torch.where eager"]
        out.append(f"| {shape} | {f['ms']:.3f} | **{f['frac_floor']:.3f}** | {c['ms']:.3f} | {c['frac_floor']:.3f} | "
                   f"{e['ms']:.3f} | {f['peak_extra_mb']:.0f} |")
    return "\n".join(out)


def main():
    d = Path(sys.argv[1] if len(sys.argv) > 1 else "benchmarks/results")
    lp = json.loads((d / "logprobs.json").read_text())
    mr = json.loads((d / "mask_reduce.json").read_text())
    print(f"copy bandwidth: logprobs run {lp['copy_gbps']:.0f} GB/s, mask_reduce run {mr['copy_gbps']:.0f} GB/s\n")
    print(logprobs_table(lp["rows"]))
    print()
    print(mask_reduce_table(mr["rows"]))


if __name__ == "__main__":
    main()
