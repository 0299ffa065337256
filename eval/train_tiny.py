"""Train a small MiMo-V2 (`MiMoV2FlashForCausalLM`) with 3 MTP layers on this machine's CPU.

    python -m eval.train_tiny [--out checkpoints/tiny-mimo-trained] [--steps N] ...

The model is the `mimo` tiny layout of `vllm_mimo.testing.tiny_model` (1 full : 6 SWA layers,
window 128, SWA attention-sink bias, 3 MTP layers, head dim 64), computed by the plain-torch
`eval.mimo_reference.MimoReference`, which matches vLLM's `mimo_v2.py` / `mimo_v2_mtp.py`.

Corpus: the installed interpreter's standard-library sources (`stdlib_text_files()`), split by
file into train and held-out sets with a fixed seed. The byte-level BPE tokenizer is trained on
the train split only. Objectives: next token for the main head; MTP layer k (k = 1..3) reads the
previous depth's hidden state at position i and the embedding of token i + k and predicts token
i + k + 1 through the shared `lm_head` (as in MiMo / DeepSeek-V3). Loss = main + w * sum(MTP k).

Training runs in bfloat16 autocast with float32 master weights (AdamW, warmup + cosine). The
result is written as a folder vLLM loads directly (bf16 `model.safetensors`, `config.json`,
tokenizer, ChatML template) plus `train_report.json` with the command, timing, the corpus split
and the held-out metrics of the exported bf16 weights: main-head loss / perplexity / top-1
accuracy, the unigram baseline, and the top-1 accuracy of each MTP head.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import math
import os
import platform
import random
import sys
import time
from pathlib import Path

from eval.corpus import HELDOUT_FRACTION, SPLIT_SEED, corpus_split, encode_files, stdlib_root

DEFAULT_OUT = "checkpoints/tiny-mimo-trained"
def _tune_malloc() -> None:
    """Keep freed memory in the heap (glibc): re-faulting the big logits buffers every step
    otherwise costs about a third of the step time on a small VM."""
    try:
        libc = ctypes.CDLL("libc.so.6")
        libc.mallopt(-4, 0)  # M_MMAP_MAX: no mmap'ed chunks
        libc.mallopt(-1, 2**31 - 1)  # M_TRIM_THRESHOLD: never give the heap top back
    except OSError:
        pass


def _fmt_time(seconds: float) -> str:
    seconds = max(0, int(seconds))
    h, rem = divmod(seconds, 3600)
    m, s = divmod(rem, 60)
    return f"{h}h{m:02d}m{s:02d}s" if h else f"{m}m{s:02d}s"


def head_losses(model, batch, num_mtp: int, detach_trunk: bool = False):
    """Cross-entropy and top-1 hits of the main head (index 0) and each MTP head on [B, T] ids
    (`detach_trunk`: `MimoReference.all_heads`'s).

    Returns (losses, hits, counts): tensors of length 1 + num_mtp; losses are means per head.
    """
    import torch
    import torch.nn.functional as F

    t = batch.shape[1]
    hs = model.all_heads(batch, num_mtp, detach_trunk)
    losses, hits, counts = [], [], []
    for k, h in enumerate(hs):
        logits = model.logits(h[:, : t - k - 1]).float()
        target = batch[:, k + 1 :]
        losses.append(F.cross_entropy(logits.reshape(-1, logits.shape[-1]), target.reshape(-1)))
        with torch.no_grad():
            hits.append((logits.argmax(-1) == target).sum())
            counts.append(target.numel())
    return torch.stack(losses), torch.stack(hits), torch.tensor(counts)


def evaluate(model, stream, seq_len: int, num_mtp: int, max_chunks: int | None = None, batch_size: int = 8) -> dict:
    """Held-out metrics over non-overlapping `seq_len` chunks of `stream` (no autocast: float32
    when the model is float32)."""
    import torch

    n = len(stream) // seq_len
    chunks = stream[: n * seq_len].view(n, seq_len).long()
    if max_chunks is not None:
        chunks = chunks[:max_chunks]
    tot_loss = torch.zeros(num_mtp + 1, dtype=torch.float64)
    tot_hits = torch.zeros(num_mtp + 1, dtype=torch.float64)
    tot_n = torch.zeros(num_mtp + 1, dtype=torch.float64)
    was_training = model.training
    model.eval()
    with torch.no_grad():
        for i in range(0, len(chunks), batch_size):
            batch = chunks[i : i + batch_size]
            losses, hits, counts = head_losses(model, batch, num_mtp)
            tot_loss += losses.double() * counts
            tot_hits += hits.double()
            tot_n += counts
    model.train(was_training)
    loss = (tot_loss / tot_n).tolist()
    acc = (tot_hits / tot_n).tolist()
    return {
        "tokens": int(tot_n[0]),
        "main_loss": loss[0],
        "main_perplexity": math.exp(loss[0]),
        "main_top1": acc[0],
        "mtp_loss": loss[1:],
        "mtp_top1": acc[1:],
    }


def unigram_baseline(train_stream, heldout_stream, vocab_size: int) -> dict:
    """Add-one unigram model from the train stream, scored on held-out next tokens."""
    import torch

    counts = torch.bincount(train_stream.long(), minlength=vocab_size).double()
    logp = torch.log((counts + 1) / (counts.sum() + vocab_size))
    target = heldout_stream[1:].long()
    loss = float(-logp[target].mean())
    top = int(counts.argmax())
    return {
        "loss": loss,
        "perplexity": math.exp(loss),
        "top1": float((target == top).double().mean()),
        "most_frequent_token": top,
    }


class ThreadTuner:
    """Torch thread count for the training steps.

    A fixed count (--threads N) is used as given. With --threads 0 the trainer compares 1 thread
    with all CPUs every 50 steps (4 steps each) and keeps the faster: on a machine whose cores
    are shared, an OpenMP team of 2 threads runs at the pace of its slowest thread, and a single
    thread on the idle core is then several times faster.
    """

    PERIOD = 50
    PROBE = 4

    def __init__(self, threads: int) -> None:
        import torch

        self.torch = torch
        self.fixed = threads > 0
        n = os.cpu_count() or 1
        self.options = [threads] if self.fixed else sorted({1, n})
        self.best = self.options[-1]
        self.current = self.best
        self.times: dict[int, list[float]] = {o: [] for o in self.options}
        self.probing: int | None = None
        torch.set_num_threads(self.current)

    def _set(self, n: int) -> None:
        if n != self.current:
            self.torch.set_num_threads(n)
            self.current = n

    def before_step(self, step: int) -> None:
        if len(self.options) == 1:
            return
        phase = step % self.PERIOD
        if phase == 0:
            self.times = {o: [] for o in self.options}
        # steps 0..PROBE-1 of each period: the best so far; PROBE..2*PROBE-1: the other option
        if phase < self.PROBE:
            self._set(self.best)
        elif phase < 2 * self.PROBE:
            self._set(next(o for o in self.options if o != self.best))
        elif phase == 2 * self.PROBE:
            means = {o: sorted(t)[len(t) // 2] for o, t in self.times.items() if t}
            if len(means) == len(self.options):
                self.best = min(means, key=means.get)
            self._set(self.best)

    def after_step(self, seconds: float) -> None:
        if len(self.options) > 1:
            self.times[self.current].append(seconds)


def _state_args(args) -> dict:
    """The settings a resumed run must share with the run that saved the state."""
    keep = ("vocab_size", "hidden_size", "intermediate_size", "layers", "mtp_layers", "split_seed",
            "heldout_fraction", "tokenizer_bytes", "seq_len", "steps", "batch_size", "lr", "min_lr_ratio",
            "warmup_steps", "weight_decay", "grad_clip", "mtp_weight", "seed", "init", "copy_fraction", "mtp_detach")
    return {k: getattr(args, k) for k in keep}


def lr_at(step: int, args) -> float:
    if step < args.warmup_steps:
        return args.lr * (step + 1) / args.warmup_steps
    progress = min(1.0, (step - args.warmup_steps) / max(1, args.steps - args.warmup_steps))
    floor = args.lr * args.min_lr_ratio
    return floor + (args.lr - floor) * 0.5 * (1 + math.cos(math.pi * progress))


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m eval.train_tiny",
        description=(
            "Train a small MiMo-V2 model (vLLM's MiMoV2FlashForCausalLM: 1 full : 6 SWA layers, "
            "window 128, attention sinks, 3 MTP layers) on the Python standard library, on CPU, "
            "and write a folder vLLM loads. Prints tokens/s, the loss of every head and the time "
            "left; ends with held-out metrics of the exported bf16 weights."
        ),
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    g = p.add_argument_group("output")
    g.add_argument("--out", default=DEFAULT_OUT, help="model folder to write (created; files in it are overwritten)")
    g = p.add_argument_group("model (the tiny `mimo` layout; defaults give ~8.4M parameters, ~17 MB in bf16)")
    g.add_argument("--vocab-size", type=int, default=4096, help="BPE vocabulary size, special tokens included")
    g.add_argument("--hidden-size", type=int, default=256, help="model width")
    g.add_argument("--intermediate-size", type=int, default=512, help="MLP width (SiLU-gated)")
    g.add_argument(
        "--layers", type=int, default=7, help="main decoder layers; layer i is full attention when i %% 7 == 0, else SWA"
    )
    g.add_argument("--mtp-layers", type=int, default=3, help="MTP layers (model.mtp.layers.*) trained and exported")
    g = p.add_argument_group("data")
    g.add_argument(
        "--split-seed", type=int, default=SPLIT_SEED, help="seed of the by-file train / held-out split of the stdlib sources"
    )
    g.add_argument(
        "--heldout-fraction",
        type=float,
        default=HELDOUT_FRACTION,
        help="fraction of files held out (never trained on, tokenizer included)",
    )
    g.add_argument(
        "--tokenizer-bytes", type=int, default=4_000_000, help="characters of train text the BPE tokenizer is trained on"
    )
    g.add_argument(
        "--seq-len", type=int, default=512, help="tokens per training sequence (windows at random offsets of the train stream)"
    )
    g = p.add_argument_group("fine-tune (from a trained folder, on a mix with the copy task)")
    g.add_argument(
        "--init",
        help="start from this model folder's weights, config and tokenizer (the model and tokenizer options above "
             "are then ignored) instead of training from scratch",
    )
    g.add_argument(
        "--copy-fraction",
        type=float,
        default=0.0,
        help="share of each batch's sequences that are `eval.copy_task` episodes (tool-call answers copying spans "
             "from the prompt, near and far); the rest is standard-library text",
    )
    g.add_argument(
        "--mtp-detach",
        action="store_true",
        help="the MTP layers read the main model's hidden states without a gradient into it: the trunk learns from "
             "the main head's loss alone, the MTP layers from theirs (so what they copy they find through their own "
             "attention, as an SWA drafter must)",
    )
    g = p.add_argument_group("optimisation")
    g.add_argument("--steps", type=int, default=1600, help="optimizer steps")
    g.add_argument("--batch-size", type=int, default=8, help="sequences per step (tokens per step = batch-size * seq-len)")
    g.add_argument("--lr", type=float, default=3e-3, help="peak AdamW learning rate")
    g.add_argument("--min-lr-ratio", type=float, default=0.05, help="final learning rate as a fraction of --lr (cosine decay)")
    g.add_argument("--warmup-steps", type=int, default=100, help="linear warmup steps")
    g.add_argument(
        "--weight-decay", type=float, default=0.1, help="AdamW weight decay on matrices (not on norms, sinks, embeddings)"
    )
    g.add_argument("--grad-clip", type=float, default=1.0, help="global gradient-norm clip")
    g.add_argument("--mtp-weight", type=float, default=0.3, help="loss weight of each MTP head (the main head has weight 1)")
    g.add_argument("--seed", type=int, default=1234, help="seed for weight init and batch sampling")
    g = p.add_argument_group("runtime")
    g.add_argument(
        "--threads",
        type=int,
        default=0,
        help="torch threads; 0: measure 1 thread against all CPUs every 50 steps and use the faster (best when the "
             "cores are shared)",
    )
    g.add_argument(
        "--state",
        default="out/train_tiny_state.pt",
        help="training state (weights, optimizer, sampler) saved every --save-every steps, for --resume",
    )
    g.add_argument("--save-every", type=int, default=100, help="save the training state every N steps (0: never)")
    g.add_argument(
        "--resume",
        action="store_true",
        help="continue from --state if it exists (same settings required); the result equals an uninterrupted run up to "
             "thread-count numerics",
    )
    g.add_argument("--log-every", type=int, default=20, help="print a progress line every N steps")
    g.add_argument("--eval-every", type=int, default=400, help="held-out check (a subset) every N steps; 0: only at the end")
    g.add_argument("--eval-chunks", type=int, default=32, help="held-out sequences used by the periodic check")
    g.add_argument(
        "--final-eval-chunks", type=int, default=0, help="held-out sequences for the final metrics (0: the whole held-out split)"
    )
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.steps < 1 or args.batch_size < 1 or args.seq_len < 8:
        raise SystemExit("--steps and --batch-size must be >= 1 and --seq-len >= 8")
    if not 0 < args.heldout_fraction < 1:
        raise SystemExit("--heldout-fraction must be in (0, 1)")
    if not 0 <= args.copy_fraction <= 1:
        raise SystemExit(f"--copy-fraction {args.copy_fraction}: must be in [0, 1]")
    if args.init and not (Path(args.init) / "config.json").is_file():
        raise SystemExit(f"--init {args.init}: no config.json there")
    _tune_malloc()

    import torch

    from eval.mimo_reference import MimoReference, export_tensors, init_weights, load_reference
    from vllm_mimo.testing.tiny_model import (
        SPECIAL_TOKENS,
        ModelSize,
        make_config,
        parameter_shapes,
        train_tokenizer,
        write_model_folder,
    )

    torch.set_num_threads(args.threads or os.cpu_count() or 1)  # tokenizer + setup; ThreadTuner takes over
    torch.manual_seed(args.seed)
    t_start = time.time()
    out = Path(args.out)

    def log(msg: str) -> None:
        print(f"[train_tiny {_fmt_time(time.time() - t_start)}] {msg}", flush=True)

    train_files, held_files = corpus_split(args.split_seed, args.heldout_fraction)
    log(f"corpus: {len(train_files)} train files, {len(held_files)} held-out files from {stdlib_root()}")
    if args.init:
        from tokenizers import Tokenizer

        tok = Tokenizer.from_file(str(Path(args.init) / "tokenizer.json"))
    else:
        tok = train_tokenizer(args.vocab_size, train_files, max_bytes=args.tokenizer_bytes)
    ids = {t: tok.token_to_id(t) for t in SPECIAL_TOKENS}
    eot = ids["<|endoftext|>"]
    train_stream = encode_files(tok, train_files, eot)
    held_stream = encode_files(tok, held_files, eot)
    log(f"tokenizer: {tok.get_vocab_size()} tokens; train {len(train_stream):,} tokens, held-out {len(held_stream):,} tokens")

    size = ModelSize(
        vocab_size=args.vocab_size,
        hidden_size=args.hidden_size,
        intermediate_size=args.intermediate_size,
    )
    if args.init:
        model = load_reference(args.init, torch.float32).train()
        config = model.config
        args.mtp_layers = model.num_mtp_layers
        log(f"initialised from {args.init}")
    else:
        config = make_config("mimo", size, num_layers=args.layers, num_mtp_layers=args.mtp_layers, token_ids=ids)
        model = MimoReference(config)
        init_weights(model, args.seed)
    model.set_fast_attention(True)
    names = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    if names != parameter_shapes(config):
        raise RuntimeError("reference parameter names differ from the checkpoint layout")
    n_params = sum(p.numel() for p in model.parameters())
    log(f"model: {n_params / 1e6:.2f}M parameters, {args.layers} layers {config['hybrid_layer_pattern']} + {args.mtp_layers} MTP")

    decay = [p for n, p in model.named_parameters() if p.ndim == 2 and "embed_tokens" not in n]
    no_decay = [p for n, p in model.named_parameters() if not (p.ndim == 2 and "embed_tokens" not in n)]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": args.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=args.lr,
        betas=(0.9, 0.95),
        eps=1e-8,
    )
    gen = torch.Generator().manual_seed(args.seed)
    copy_rng = random.Random(args.seed)
    copy_task = None
    if args.copy_fraction:
        from eval.copy_task import CopyTask

        copy_task = CopyTask(tok)
    weights = torch.tensor([1.0] + [args.mtp_weight] * args.mtp_layers)
    tokens_per_step = args.batch_size * args.seq_len
    max_start = len(train_stream) - args.seq_len
    log(
        f"training {args.steps} steps x {tokens_per_step} tokens = {args.steps * tokens_per_step / 1e6:.1f}M tokens "
        f"({args.steps * tokens_per_step / len(train_stream):.2f} epochs), threads: "
        f"{args.threads or 'adaptive 1..' + str(os.cpu_count())}"
    )

    state_path = Path(args.state)
    first_step, prior_seconds, running = 0, 0.0, None
    if args.resume and state_path.exists():
        state = torch.load(state_path, weights_only=False)
        if state["args"] != _state_args(args):
            raise SystemExit(f"{state_path} was written with other settings; remove it or drop --resume")
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["opt"])
        gen.set_state(state["gen"])
        copy_rng.setstate(state["copy_rng"])
        first_step, prior_seconds, running = state["step"], state["seconds"], state["running"]
        log(f"resumed from {state_path} at step {first_step} ({_fmt_time(prior_seconds)} of training so far)")

    threads = ThreadTuner(args.threads)
    t_train = time.time() - prior_seconds
    t_window, tokens_window = time.time(), 0
    for step in range(first_step, args.steps):
        threads.before_step(step)
        t_step = time.perf_counter()
        lr = lr_at(step, args)
        for group in opt.param_groups:
            group["lr"] = lr
        starts = torch.randint(0, max_start, (args.batch_size,), generator=gen)
        rows = [train_stream[s : s + args.seq_len] for s in starts.tolist()]
        if copy_task is not None:
            for i in range(len(rows)):
                if copy_rng.random() < args.copy_fraction:
                    rows[i] = torch.tensor(copy_task.training_sequence(copy_rng, train_stream, args.seq_len))
        batch = torch.stack(rows).long()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            losses, _, _ = head_losses(model, batch, args.mtp_layers, args.mtp_detach)
        loss = (losses * weights).sum()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), args.grad_clip)
        opt.step()
        threads.after_step(time.perf_counter() - t_step)
        tokens_window += tokens_per_step
        detached = losses.detach()
        running = detached if running is None else 0.9 * running + 0.1 * detached
        done = step + 1
        if done % args.log_every == 0 or done == args.steps:
            now = time.time()
            tps = tokens_window / (now - t_window)
            t_window, tokens_window = now, 0
            left = (args.steps - done) * (now - t_train) / done
            heads = " ".join(
                [f"main {running[0]:.3f}"] + [f"mtp{k} {running[k]:.3f}" for k in range(1, len(running))]
            )
            log(
                f"step {done}/{args.steps} | {done * tokens_per_step / 1e6:.2f}M tok | {tps:,.0f} tok/s "
                f"({threads.current} thr) | loss {heads} | lr {lr:.2e} | "
                f"{_fmt_time(now - t_train)} elapsed, ~{_fmt_time(left)} left"
            )
        if args.eval_every and done % args.eval_every == 0 and done != args.steps:
            with torch.autocast("cpu", dtype=torch.bfloat16):
                m = evaluate(model, held_stream, args.seq_len, args.mtp_layers, args.eval_chunks)
            log(
                f"held-out check ({m['tokens']:,} tokens): main loss {m['main_loss']:.3f} top1 {m['main_top1']:.1%} | "
                + " ".join(f"mtp{k + 1} top1 {a:.1%}" for k, a in enumerate(m["mtp_top1"]))
            )
        if args.save_every and done % args.save_every == 0 and done != args.steps:
            state_path.parent.mkdir(parents=True, exist_ok=True)
            tmp = state_path.with_suffix(".tmp")
            torch.save(
                {
                    "args": _state_args(args),
                    "model": model.state_dict(),
                    "opt": opt.state_dict(),
                    "gen": gen.get_state(),
                    "copy_rng": copy_rng.getstate(),
                    "step": done,
                    "seconds": time.time() - t_train,
                    "running": running,
                },
                tmp,
            )
            os.replace(tmp, state_path)
    train_seconds = time.time() - t_train
    log(f"training done in {_fmt_time(train_seconds)}")

    tensors = export_tensors(model, torch.bfloat16)
    write_model_folder(out, config, tensors, tok)
    log(f"wrote {out} ({(out / 'model.safetensors').stat().st_size / 1e6:.1f} MB of bf16 weights)")

    # Held-out metrics of what was exported: the bf16 weights, computed in float32.
    exported = load_reference(out, torch.float32).set_fast_attention(True)
    final = evaluate(
        exported, held_stream, args.seq_len, args.mtp_layers, args.final_eval_chunks or None
    )
    uni = unigram_baseline(train_stream, held_stream, args.vocab_size)
    root = stdlib_root()
    report = {
        "command": " ".join(["python -m eval.train_tiny", *(argv if argv is not None else sys.argv[1:])]),
        "args": vars(args),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cpus": os.cpu_count(),
        "train_seconds": round(train_seconds, 1),
        "total_seconds": round(time.time() - t_start, 1),
        "parameters": n_params,
        "train_tokens_seen": args.steps * tokens_per_step,
        "corpus": {
            "stdlib": str(root),
            "train_files": len(train_files),
            "train_tokens": len(train_stream),
            "heldout_tokens": len(held_stream),
            "heldout_files": [str(p.relative_to(root)) for p in held_files],
        },
        "heldout": final,
        "unigram_baseline": uni,
    }
    (out / "train_report.json").write_text(json.dumps(report, indent=2) + "\n")
    log(
        f"held-out ({final['tokens']:,} tokens, exported bf16 weights): main loss {final['main_loss']:.3f} "
        f"(perplexity {final['main_perplexity']:.2f}), top-1 {final['main_top1']:.1%} vs unigram top-1 "
        f"{uni['top1']:.1%} (unigram loss {uni['loss']:.3f})"
    )
    for k, (loss, top1) in enumerate(zip(final["mtp_loss"], final["mtp_top1"], strict=True), 1):
        log(f"held-out MTP head {k} (predicts token i+{k + 1}): loss {loss:.3f}, top-1 {top1:.1%}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
