"""Run one vLLM `LLM()` engine and print its results as JSON (the tests start this in a subprocess).

Reads a JSON job on stdin: {"model", "llm_kwargs", "max_tokens", "batches": [[[ids...], ...], ...]}.
Each batch is one `generate` call, in order, so a later batch can hit the prefix cache left by an
earlier one. Prints one line `RESULT {...}` with the greedy token ids, cached-token counts and a
report from every worker process.
"""

import json
import sys


def worker_report(worker) -> dict:
    """Runs inside each vLLM worker process: registration state and the attention layers built."""
    import os

    from vllm_mimo import hooks

    layers = []
    for name, module in worker.model_runner.model.named_modules():
        if hasattr(module, "sliding_window") and hasattr(module, "has_sink"):
            layers.append(
                {"name": name, "sliding_window": module.sliding_window, "has_sink": module.has_sink}
            )
    return {"pid": os.getpid(), "registered": hooks.registered(), "attention_layers": layers}


def main() -> None:
    job = json.loads(sys.stdin.read())
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    llm = LLM(job["model"], **job["llm_kwargs"])
    params = SamplingParams(temperature=0.0, max_tokens=job["max_tokens"], ignore_eos=True)
    batches = []
    for batch in job["batches"]:
        outputs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in batch], params, use_tqdm=False)
        batches.append(
            [{"ids": list(o.outputs[0].token_ids), "cached": o.num_cached_tokens} for o in outputs]
        )
    workers = llm.collective_rpc(worker_report)
    print("RESULT " + json.dumps({"batches": batches, "workers": workers}), flush=True)


if __name__ == "__main__":
    main()
