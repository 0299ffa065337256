"""Run one vLLM `LLM()` engine and print its results as JSON (the tests start this in a subprocess).

Reads a JSON job on stdin:
  model, llm_kwargs, max_tokens
  batches:  [[prompt, ...], ...]  one `generate` call per batch, in order, so a later batch can
            hit the prefix cache left by an earlier one; a prompt is a list of token ids or
            {"ids": [...], "extra_args": {...}}; a batch {"expect_error": [prompt, ...]} is one
            that `generate` must refuse: its result is {"error": the message, or None}
  sessions: {"system": [ids], "turns": [[user message ids, ...], ...]}  (optional) multi-turn
            chats: turn k of user u is the previous turn's prompt and answer plus the message
  script:   [{"step": k, "ids": [...], "priority": p, "extra_args": {...}}, ...]  (optional) requests
            added to the engine at its k-th step (0: before the first), with vLLM's priority;
            the engine is stepped until all are done: {"script": {index: {"ids", "cached"}}}
  record_block_ids: true to report every block id the worker's KV groups received
  linger:   a file path (optional): after the RESULT line, stay up (engine and all) until that
            file exists, 600 s at most (a test's second instance reads what this one holds)
  patch:    "module:function" called before the engine starts (a negative control's change to
            the plugin; it reaches the engine core when that runs in this process,
            VLLM_ENABLE_V1_MULTIPROCESSING=0, as tests.conftest.run_engine starts it)
Prints one line `RESULT {...}`: greedy token ids and cached-token counts per prompt, a report
from every worker process, the plugin's KV manager metrics and vLLM's preemption count.
"""

import json
import sys


def worker_report(worker) -> dict:
    """Runs inside each vLLM worker process: registration state, layers built, ids received."""
    import os

    from vllm_mimo import hooks

    layers = []
    for name, module in worker.model_runner.model.named_modules():
        if hasattr(module, "sliding_window") and hasattr(module, "has_sink"):
            layers.append(
                {"name": name, "sliding_window": module.sliding_window, "has_sink": module.has_sink}
            )
    specs = [g.kv_cache_spec for g in worker.model_runner.kv_cache_config.kv_cache_groups]
    return {
        "pid": os.getpid(),
        "registered": hooks.registered(),
        "attention_layers": layers,
        "group_kinds": [type(spec).__name__ for spec in specs],
        "block_sizes": [spec.block_size for spec in specs],
        "block_ids": getattr(worker.model_runner, "_test_block_ids", None),
    }


def record_block_ids(worker) -> None:
    """Runs inside each worker: remember the block ids each KV group receives from now on."""
    runner = worker.model_runner
    seen: list = []
    runner._test_block_ids = seen
    update = runner._update_states

    def _update_states(scheduler_output, *args, **kwargs):
        for req in scheduler_output.scheduled_new_reqs:
            seen.append([list(ids) for ids in req.block_ids])
        for ids in scheduler_output.scheduled_cached_reqs.new_block_ids:
            if ids is not None:
                seen.append([list(group) for group in ids])
        return update(scheduler_output, *args, **kwargs)

    runner._update_states = _update_states


def _prompt(spec):
    from vllm.inputs import TokensPrompt

    ids = spec["ids"] if isinstance(spec, dict) else spec
    return TokensPrompt(prompt_token_ids=ids), (spec.get("extra_args") if isinstance(spec, dict) else None)


def run_script(llm, arrivals: list[dict], max_tokens: int) -> dict:
    """Add each request at its step, step the engine until every one is done."""
    from vllm import SamplingParams

    engine, done, step = llm.llm_engine, {}, 0
    pending = sorted(enumerate(arrivals), key=lambda a: a[1]["step"])
    while pending or engine.has_unfinished_requests():
        while pending and pending[0][1]["step"] <= step:
            i, arrival = pending.pop(0)
            prompt, _ = _prompt(arrival["ids"])
            params = SamplingParams(
                temperature=0.0, max_tokens=max_tokens, ignore_eos=True, extra_args=arrival.get("extra_args")
            )
            engine.add_request(str(i), prompt, params, priority=arrival.get("priority", 0))
        for output in engine.step():
            if output.finished:
                done[output.request_id] = {"ids": list(output.outputs[0].token_ids), "cached": output.num_cached_tokens}
        step += 1
    return done


def main() -> None:
    job = json.loads(sys.stdin.read())
    if job.get("patch"):
        import importlib
        from pathlib import Path

        sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
        module, function = job["patch"].split(":")
        getattr(importlib.import_module(module), function)()
    from vllm import LLM, SamplingParams

    llm = LLM(job["model"], **job["llm_kwargs"])
    if job.get("record_block_ids"):
        llm.collective_rpc(record_block_ids)

    def generate(specs):
        prompts, params = [], []
        for spec in specs:
            prompt, extra = _prompt(spec)
            prompts.append(prompt)
            params.append(SamplingParams(temperature=0.0, max_tokens=job["max_tokens"], ignore_eos=True, extra_args=extra))
        outputs = llm.generate(prompts, params, use_tqdm=False)
        return [{"ids": list(o.outputs[0].token_ids), "cached": o.num_cached_tokens} for o in outputs]

    def refused(specs):
        try:
            generate(specs)
        except Exception as e:
            return {"error": f"{type(e).__name__}: {e}"}
        return {"error": None}

    batches = [
        refused(batch["expect_error"]) if isinstance(batch, dict) else generate(batch)
        for batch in job.get("batches", [])
    ]
    turns = []
    if "sessions" in job:
        history = [list(job["sessions"]["system"]) for _ in job["sessions"]["turns"][0]]
        for messages in job["sessions"]["turns"]:
            prompts = [h + m for h, m in zip(history, messages, strict=True)]
            results = generate(prompts)
            history = [p + r["ids"] for p, r in zip(prompts, results, strict=True)]
            turns.append(results)
    script = run_script(llm, job["script"], job["max_tokens"]) if "script" in job else {}
    workers = llm.collective_rpc(worker_report)

    from vllm_mimo.metrics import kv_manager_metrics

    try:
        mimo = kv_manager_metrics()
    except RuntimeError:
        mimo = None
    preemptions = None
    if not job["llm_kwargs"].get("disable_log_stats", True):
        preemptions = sum(m.value for m in llm.get_metrics() if m.name == "vllm:num_preemptions")
    print(
        "RESULT " + json.dumps(
            {"batches": batches, "turns": turns, "script": script, "workers": workers, "mimo": mimo, "preemptions": preemptions}
        ),
        flush=True,
    )
    if job.get("linger"):
        import time
        from pathlib import Path

        deadline = time.monotonic() + 600
        while not Path(job["linger"]).exists() and time.monotonic() < deadline:
            time.sleep(0.2)


if __name__ == "__main__":
    main()
