"""Mutation test of ``numerics check``: each mutant is one small text edit applied to a scratch copy of
``reference_trainer/`` (planted bugs, off-by-one masks, scale factors, dropped terms, dtype cast
points, shared-config derivations, and harmless reorderings of a sum), run through
``python -m numerics check --json`` on a tiny model (1 step, 1-4 ranks) from the scratch folder so
the mutant trainer is the one spawned. Prints, per mutant: the exit code, whether it was caught
(a bug: exit 1; a reordering: exit 4 or 0), classified right (bug/order) and located (a bug's
location names the stage/TP rank/shard/rank, a data or pipeline finding, or the loss all-reduce).

    PYTHONPATH=$PWD python benchmarks/numerics_mutants.py [--only NAME ...] [--keep DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TINY = ["--n-layers", "2", "--steps", "1", "--micro-batches", "2", "--seq-len", "64"]

# name, expected ("bug" | "order"), file, old text, new text, trainer args
MUTANTS: list[tuple[str, str, str, str, str, list[str]]] = [
    ("tokens_per_step without dp", "bug", "config.py",
     "return self.dp * self.micro_batches * self.micro_batch_size * self.seq_len",
     "return self.micro_batches * self.micro_batch_size * self.seq_len", ["--dp", "2"]),
    ("canonical sum drops last rank", "bug", "comm.py", "    for t in terms[1:]:\n", "    for t in terms[1:-1]:\n",
     ["--dp", "3", "--reduce-order", "canonical"]),
    ("pipeline split drops last layer", "bug", "model.py", "        out.append(range(start, start + c))",
     "        out.append(range(start, start + c - (start + c == n_layers)))", ["--dp", "2"]),
    ("gradient scaled x(1+1e-7)", "bug", "data_parallel.py", "            self.reduced = shard.to(torch.float32, copy=True)",
     "            self.reduced = (shard * (1 + 1e-7)).to(torch.float32, copy=True)", ["--dp", "2"]),
    ("gradient scaled x(1+1e-7), 3 ranks", "bug", "data_parallel.py",
     "            self.reduced = shard.to(torch.float32, copy=True)",
     "            self.reduced = (shard * (1 + 1e-7)).to(torch.float32, copy=True)", ["--dp", "3"]),
    ("gradient averaged over dp", "bug", "data_parallel.py", "            self.reduced = shard.to(torch.float32, copy=True)",
     "            self.reduced = (shard / ctx.dp_cp.size).to(torch.float32, copy=True)", ["--dp", "2"]),
    ("loss normalized off by one token", "bug", "model.py", "return losses.sum() / self.cfg.tokens_per_step",
     "return losses.sum() / (self.cfg.tokens_per_step - 1)", ["--dp", "2"]),
    ("rms_norm eps dropped", "bug", "model.py", "torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)",
     "torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + 0.0 * eps)", ["--tp", "2"]),
    ("rope frequency off by one", "bug", "model.py", "dtype=torch.float32) / d))", "dtype=torch.float32) / (d + 1)))",
     ["--cp", "2"]),
    ("adam bias correction off by one", "bug", "data_parallel.py", "m_hat = m / (1 - cfg.beta1 ** step)",
     "m_hat = m / (1 - cfg.beta1 ** (step + 1))", ["--dp", "2"]),
    ("weight decay dropped", "bug", "data_parallel.py", "    p.mul_(1 - cfg.lr * cfg.weight_decay)\n", "",
     ["--dp", "2"]),
    ("rms_norm weight multiplied before the cast", "bug", "model.py",
     "return (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype) * weight",
     "return (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps) * weight.float()).to(x.dtype)", ["--tp", "2"]),
    ("reduce before the bf16 cast", "bug", "data_parallel.py",
     "shard = comm.reduce_scatter(self.grad.to(DTYPES[self.cfg.reduce_dtype]), ctx.dp_cp)",
     "shard = comm.reduce_scatter(self.grad, ctx.dp_cp).to(DTYPES[self.cfg.reduce_dtype])",
     ["--dp", "2", "--reduce-dtype", "bf16"]),
    ("accumulation buffer always bf16", "bug", "data_parallel.py",
     "self.accum_dtype = DTYPES[cfg.grad_accum_dtype]", "self.accum_dtype = torch.bfloat16",
     ["--dp", "2", "--micro-batches", "3"]),
    ("causal mask lets a token miss itself", "bug", "context_parallel.py",
     "(k_pos[:, None, :] <= q_pos[:, :, None])", "(k_pos[:, None, :] < q_pos[:, :, None]) | (k_pos[:, None, :] == 0)",
     ["--cp", "2"]),
    ("document mask key one position late", "bug", "context_parallel.py",
     "        k_doc = torch.gather(doc, 1, k_pos)\n",
     "        k_doc = torch.gather(doc, 1, (k_pos + 1).clamp(max=doc.shape[1] - 1))\n", ["--cp", "2"]),
    ("cp second chunk off by one", "bug", "context_parallel.py",
     "second = 2 * cp - 2 if bugs.active(\"cp-chunk\") else 2 * cp - 1", "second = 2 * cp - 2", ["--cp", "2"]),
    ("tp backward reduce skipped", "bug", "model.py", "bwd_reduce=not bugs.active(\"tp-bwd-reduce\"))",
     "bwd_reduce=False)", ["--tp", "2"]),
    ("tp backward reduce skipped, pp 2", "bug", "model.py", "bwd_reduce=not bugs.active(\"tp-bwd-reduce\"))",
     "bwd_reduce=False)", ["--tp", "2", "--pp", "2", "--n-layers", "4"]),
    ("embedding vocab shard off by one", "bug", "model.py",
     "self.vocab_start = tp_rank * (cfg.vocab_size // tp)", "self.vocab_start = tp_rank * (cfg.vocab_size // tp) + tp_rank",
     ["--tp", "2"]),
    ("every dp replica reads replica 0's data", "bug", "data.py",
     "mine = batch[dp_rank * per_replica:(dp_rank + 1) * per_replica]", "mine = batch[0:per_replica]", ["--dp", "2"]),
    ("data seed off by one", "bug", "data.py", "rng = np.random.default_rng([c.seed, step])",
     "rng = np.random.default_rng([c.seed + 1, step])", ["--dp", "2"]),
    ("eos belongs to the next document", "bug", "data.py", "starts = torch.cumsum(ends, dim=-1) - ends",
     "starts = torch.cumsum(ends, dim=-1)", ["--cp", "2"]),
    ("zero-2 shard sum never cleared", "bug", "data_parallel.py", "        self.grad_shard.zero_()\n", "",
     ["--dp", "2", "--zero-stage", "2", "--steps", "2"]),
    ("norm-weight TP all-reduce dropped", "bug", "data_parallel.py",
     "            self.grad[self.replicated] = comm.all_reduce(self.grad[self.replicated], ctx.tp)\n",
     "            pass\n", ["--tp", "2"]),
    ("cross-entropy picks the neighbour's logit", "bug", "tensor_parallel.py",
     "g.scatter_add_(-1, local_t.unsqueeze(-1), -inside.to(g.dtype).unsqueeze(-1))",
     "g.scatter_add_(-1, (local_t.unsqueeze(-1) + 1) % g.shape[-1], -inside.to(g.dtype).unsqueeze(-1))", ["--tp", "2"]),
    # harmless: the same sums in another association; --strict-order (fp32 compute, bf16 buffers and
    # reduce) makes the changed rounding visible, and groups of 3-4 ranks make the order matter
    ("canonical sum reversed", "order", "comm.py", "    acc = terms[0].clone()\n    for t in terms[1:]:\n",
     "    terms = list(reversed(terms))\n    acc = terms[0].clone()\n    for t in terms[1:]:\n",
     ["--strict-order", "--dp", "3", "--reduce-order", "canonical"]),
    ("canonical sum as a pairwise tree", "order", "comm.py", "    acc = terms[0].clone()\n    for t in terms[1:]:\n        acc.add_(t)",
     "    level = list(terms)\n    while len(level) > 1:\n        level = [level[i] + level[i + 1] if i + 1 < len(level) else level[i] "
     "for i in range(0, len(level), 2)]\n    acc = level[0].clone()\n    for t in []:\n        acc.add_(t)",
     ["--strict-order", "--dp", "4", "--reduce-order", "canonical"]),
    ("canonical sum in fp64", "order", "comm.py", "    acc = terms[0].clone()\n    for t in terms[1:]:\n        acc.add_(t)",
     "    acc = terms[0].double()\n    for t in terms[1:]:\n        acc.add_(t.double())\n    acc = acc.to(terms[0].dtype)",
     ["--strict-order", "--dp", "3", "--reduce-order", "canonical"]),
    ("dp reduce canonical in a native run", "order", "data_parallel.py",
     "        shard = comm.reduce_scatter(self.grad.to(DTYPES[self.cfg.reduce_dtype]), ctx.dp_cp)\n",
     "        was, comm.reduce_order = comm.reduce_order, \"canonical\"\n"
     "        shard = comm.reduce_scatter(self.grad.to(DTYPES[self.cfg.reduce_dtype]), ctx.dp_cp)\n"
     "        comm.reduce_order = was\n", ["--strict-order", "--dp", "3"]),
    ("dp reduce native in a canonical run", "order", "data_parallel.py",
     "        shard = comm.reduce_scatter(self.grad.to(DTYPES[self.cfg.reduce_dtype]), ctx.dp_cp)\n",
     "        was, comm.reduce_order = comm.reduce_order, \"native\"\n"
     "        shard = comm.reduce_scatter(self.grad.to(DTYPES[self.cfg.reduce_dtype]), ctx.dp_cp)\n"
     "        comm.reduce_order = was\n", ["--strict-order", "--dp", "3", "--reduce-order", "canonical"]),
    ("micro-batch accumulation in fp64", "order", "data_parallel.py",
     "self.grad = torch.zeros(self.padded, dtype=self.accum_dtype, device=dev)",
     "self.grad = torch.zeros(self.padded, dtype=torch.float64, device=dev)",
     ["--micro-batches", "4", "--compute-dtype", "fp32"]),  # fp32 buffer: the fp64 sum rounded once
    ("loss all-reduce reversed", "order", "train.py",
     "        loss = comm.all_reduce(comm.all_reduce(local_loss, self.ctx.dp_cp), self.ctx.pp)\n",
     "        from .comm import chained_sum\n"
     "        parts = comm._gather_parts(local_loss, self.ctx.dp_cp) if self.ctx.dp_cp.size > 1 else [local_loss]\n"
     "        loss = comm.all_reduce(chained_sum(parts[::-1]), self.ctx.pp)\n",
     ["--strict-order", "--dp", "4", "--reduce-order", "canonical"]),
]


def run_mutant(name: str, expect: str, file: str, old: str, new: str, args: list[str], scratch: Path) -> dict:
    shutil.rmtree(scratch, ignore_errors=True)
    shutil.copytree(ROOT / "reference_trainer", scratch / "reference_trainer",
                    ignore=shutil.ignore_patterns("__pycache__"))
    path = scratch / "reference_trainer" / file
    text = path.read_text()
    if text.count(old) != 1:
        return {"mutant": name, "expect": expect, "rc": None, "error": f"edit does not apply once to {file}"}
    path.write_text(text.replace(old, new))
    env = {**os.environ, "PYTHONPATH": f"{scratch}:{ROOT}"}
    argv = [sys.executable, "-m", "numerics", "check", "--json", *TINY, *args]
    t0 = time.monotonic()
    proc = subprocess.run(argv, cwd=scratch, env=env, capture_output=True, text=True, timeout=1200)
    row = {"mutant": name, "expect": expect, "rc": proc.returncode, "seconds": round(time.monotonic() - t0, 1)}
    try:
        report = json.loads(proc.stdout)
    except json.JSONDecodeError:
        row["error"] = (proc.stderr.strip().splitlines() or ["no output"])[-1][:160]
        return row
    row["status"] = report["status"]
    bug = report["first_bug"]
    row["where"] = (report["findings"][0] if report["findings"] else bug["buffer"] + ": " + bug["location"]
                    if bug else "; ".join(sorted({v["cause"] for v in report["verdicts"]}))[:160])
    row["located"] = bool(report["findings"]) or bool(bug and ("rank" in bug["location"]))
    return row


def judge(row: dict) -> tuple[str, str, str]:
    rc, expect = row["rc"], row["expect"]
    if expect == "bug":
        caught = rc == 1
        return ("yes" if caught else "NO", "bug" if row.get("status") == "bug" else row.get("status", "-"),
                "yes" if row.get("located") else "NO")
    caught = rc in (0, 4)
    return ("yes" if caught else "NO", row.get("status", "-"), "-")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--only", action="append", default=[], help="run mutants whose name contains this")
    ap.add_argument("--keep", type=Path, default=None, help="scratch folder (default: a temporary one)")
    opts = ap.parse_args()
    chosen = [m for m in MUTANTS if not opts.only or any(o in m[0] for o in opts.only)]
    rows = []
    with tempfile.TemporaryDirectory(prefix="numerics-mutants-") as tmp:
        base = opts.keep or Path(tmp)
        print(f"{'mutant':45s} {'expect':6s} {'rc':>3s} {'caught':6s} {'class':6s} {'located':7s} {'s':>6s}  where", flush=True)
        for i, m in enumerate(chosen):
            row = run_mutant(*m, scratch=base / f"m{i}")
            rows.append(row)
            caught, cls, located = judge(row)
            where = row.get("where") or row.get("error", "")
            print(f"{row['mutant']:45s} {row['expect']:6s} {str(row['rc']):>3s} {caught:6s} {cls:6s} {located:7s} "
                  f"{row.get('seconds', 0):6.1f}  {where}", flush=True)
    good = sum(judge(r)[0] == "yes" and (r["expect"] == "order" or (judge(r)[1] == "bug" and judge(r)[2] == "yes"))
               for r in rows)
    print(f"\n{good}/{len(rows)} mutants caught, classified and (bugs) located")


if __name__ == "__main__":
    main()
