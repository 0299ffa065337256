import os, sys, cProfile, pstats, time, random
os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
from pathlib import Path
if __name__ == "__main__":
    path, chunk = sys.argv[1], int(sys.argv[2])
    from vllm import LLM, SamplingParams
    from vllm_mimo.testing.tiny_model import make_tiny_model
    model = make_tiny_model(Path("/tmp/prof/tiny"), "mimo") if not Path("/tmp/prof/tiny/config.json").exists() else Path("/tmp/prof/tiny")
    llm = LLM(str(model), dtype="float32", enforce_eager=True, kv_cache_memory_bytes=512 << 20, max_model_len=8192,
              max_num_batched_tokens=chunk, enable_prefix_caching=False, additional_config={"mimo": {"swa_attention": path}})
    rng = random.Random(0)
    prompt = {"prompt_token_ids": [rng.randrange(10, 4000) for _ in range(4096)]}
    sp = SamplingParams(max_tokens=1, temperature=0.0)
    llm.generate([prompt], sp, use_tqdm=False)
    ts = []
    for _ in range(3):
        t = time.perf_counter(); llm.generate([prompt], sp, use_tqdm=False); ts.append(time.perf_counter() - t)
    print("TIMES", path, chunk, [round(x, 3) for x in ts])
    pr = cProfile.Profile(); pr.enable()
    for _ in range(3):
        llm.generate([prompt], sp, use_tqdm=False)
    pr.disable()
    pstats.Stats(pr).sort_stats("tottime").print_stats(25)
