#!/usr/bin/env python
"""Train the tiny Qwen3-architecture model that ships in ``nanoserve/assets/tiny-qwen3``.

The server must work offline (tests, demos, CI), so it carries its own model. The
model is trained from scratch on English text that ships with every CPython
install, so the whole pipeline needs no network and no downloaded data:

* ``pydoc_data.topics.topics`` -- the language reference topics used by ``help()``;
* docstrings of standard-library modules, classes and functions.

Usage::

    python scripts/train_tiny_model.py --minutes 20
    python scripts/train_tiny_model.py --steps 50 --out /tmp/tiny   # quick smoke test

The result is a standard Hugging Face folder (config.json, model.safetensors,
tokenizer.json, tokenizer_config.json with a ChatML chat_template,
generation_config.json) loadable with ``AutoModelForCausalLM``/``AutoTokenizer``.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import inspect
import io
import math
import os
import pkgutil
import random
import sys
import sysconfig
import time
import warnings
from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from tqdm import tqdm
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    GenerationConfig,
    PreTrainedTokenizerFast,
    Qwen3Config,
    Qwen3ForCausalLM,
)

REPO_ROOT = Path(__file__).resolve().parent.parent
DEFAULT_OUT = REPO_ROOT / "nanoserve" / "assets" / "tiny-qwen3"

EOS = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"

# Qwen-style ChatML. Kept minimal (no tools/system defaults) so that it is easy
# to reproduce in the server's own prompt-formatting code and tests.
CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}"
    "{{- '<|im_start|>assistant\\n' }}"
    "{%- endif %}"
)

# Modules that open windows/browsers, print on import, are huge test suites, or
# are otherwise unsafe or pointless to import just for their docstrings.
SKIP_TOP_LEVEL = {
    "antigravity", "this", "idlelib", "tkinter", "turtle", "turtledemo", "test",
    "__main__", "__hello__", "__phello__", "_pydev_bundle", "lib2to3", "ensurepip",
    "venv", "pydoc_data",  # pydoc_data is collected separately
}
SKIP_PARTS = {"test", "tests", "idle_test", "__main__"}

SEQ_LEN = 256


# --------------------------------------------------------------------------- corpus


def stdlib_module_names() -> list[str]:
    """All importable stdlib module names (top level + submodules), sorted."""
    # Use the base interpreter's stdlib: inside a venv "platstdlib" points at the venv.
    stdlib = sysconfig.get_path("stdlib")
    paths = [stdlib, os.path.join(stdlib, "lib-dynload")]
    names: set[str] = set(sys.builtin_module_names) | set(getattr(sys, "stdlib_module_names", ()))
    for info in pkgutil.iter_modules(paths):
        names.add(info.name)
    names = {n for n in names if n not in SKIP_TOP_LEVEL and not n.startswith("test")}

    # One level deeper for packages (email.mime, json.decoder, concurrent.futures...).
    result: set[str] = set()
    for name in sorted(names):
        result.add(name)
        mod = safe_import(name)
        if mod is None or not hasattr(mod, "__path__"):
            continue
        for info in pkgutil.walk_packages(mod.__path__, prefix=name + ".", onerror=lambda _: None):
            if not SKIP_PARTS.intersection(info.name.split(".")):
                result.add(info.name)
    return sorted(result)


def safe_import(name: str) -> object | None:
    """Import a module, swallowing errors, warnings and anything it prints."""
    if name in sys.modules:
        return sys.modules[name]
    try:
        with warnings.catch_warnings(), contextlib.redirect_stdout(io.StringIO()), \
                contextlib.redirect_stderr(io.StringIO()):
            warnings.simplefilter("ignore")
            return importlib.import_module(name)
    except BaseException:  # noqa: BLE001 - SystemExit/ImportError/anything: just skip it
        return None


def docstrings_of(mod: object) -> list[str]:
    """Docstrings of a module and of the classes/functions/methods it defines."""
    modname = getattr(mod, "__name__", "")
    docs = [inspect.getdoc(mod) or ""]
    for attr in sorted(vars(mod)):
        obj = getattr(mod, attr, None)
        if not (inspect.isclass(obj) or inspect.isroutine(obj)):
            continue
        if getattr(obj, "__module__", None) != modname:
            continue  # defined elsewhere; collected with its own module
        docs.append(inspect.getdoc(obj) or "")
        if inspect.isclass(obj):
            for meth_name in sorted(vars(obj)):
                meth = vars(obj)[meth_name]
                if inspect.isroutine(meth) or isinstance(meth, (property, classmethod, staticmethod)):
                    # getdoc on a method falls back to the base class doc; we only want its own.
                    doc = getattr(meth, "__doc__", None)
                    docs.append(inspect.cleandoc(doc) if isinstance(doc, str) else "")
    return docs


def collect_corpus() -> list[str]:
    """Deterministic, deduplicated list of English documents."""
    from pydoc_data.topics import topics

    docs: dict[str, None] = {}  # dict keeps insertion order and dedups
    for key in sorted(topics):
        docs.setdefault(topics[key].strip(), None)

    names = stdlib_module_names()
    for name in tqdm(names, desc="stdlib docstrings", mininterval=2.0):
        mod = safe_import(name)
        if mod is None:
            continue
        for doc in docstrings_of(mod):
            doc = doc.strip()
            # Very short docstrings ("Return self.") add little but many EOS tokens.
            if len(doc) >= 40:
                docs.setdefault(doc, None)
    return list(docs)


# ------------------------------------------------------------------------ tokenizer


def train_tokenizer(texts: list[str], vocab_size: int) -> PreTrainedTokenizerFast:
    """Byte-level BPE: every UTF-8 string round-trips, no unknown tokens."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOS, IM_START, IM_END],  # ids 0, 1, 2
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    hf_tok = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token=EOS,
        pad_token=EOS,
        additional_special_tokens=[IM_START, IM_END],
        model_max_length=2048,
        clean_up_tokenization_spaces=False,
    )
    hf_tok.chat_template = CHAT_TEMPLATE
    return hf_tok


def pack(token_docs: list[list[int]], eos_id: int) -> torch.Tensor:
    """Concatenate documents with EOS separators and cut into SEQ_LEN rows."""
    flat: list[int] = []
    for ids in token_docs:
        flat.extend(ids)
        flat.append(eos_id)
    n = len(flat) // SEQ_LEN
    return torch.tensor(flat[: n * SEQ_LEN], dtype=torch.long).view(n, SEQ_LEN)


# ---------------------------------------------------------------------------- model


def build_model(vocab_size: int, eos_id: int) -> Qwen3ForCausalLM:
    config = Qwen3Config(
        vocab_size=vocab_size,
        hidden_size=256,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,  # GQA, so the server's KV-cache code sees the real Qwen3 layout
        head_dim=64,
        intermediate_size=768,
        tie_word_embeddings=True,
        max_position_embeddings=2048,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        rms_norm_eps=1e-6,
        bos_token_id=eos_id,
        eos_token_id=eos_id,
        pad_token_id=eos_id,
        dtype="float32",
        architectures=["Qwen3ForCausalLM"],
    )
    return Qwen3ForCausalLM(config)


@torch.no_grad()
def evaluate(model: Qwen3ForCausalLM, data: torch.Tensor, batch_size: int) -> float:
    model.eval()
    losses = []
    for i in range(0, len(data), batch_size):
        batch = data[i : i + batch_size]
        losses.append(model(input_ids=batch, labels=batch).loss.item() * len(batch))
    model.train()
    return sum(losses) / len(data)


def train(args: argparse.Namespace, model: Qwen3ForCausalLM, train_data: torch.Tensor) -> float:
    """AdamW + linear warmup + cosine decay. Returns mean loss of the last 50 steps.

    With --minutes the schedule runs on elapsed wall-clock time (progress =
    elapsed/budget), so the LR reaches its floor exactly when the budget ends
    regardless of machine speed; with --steps it runs on the step count.
    """
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
        lr=args.lr, betas=(0.9, 0.95),
    )
    gen = torch.Generator().manual_seed(args.seed)
    budget_s = args.minutes * 60.0
    recent: list[float] = []
    start = time.monotonic()
    step = 0
    perm = torch.randperm(len(train_data), generator=gen)
    cursor = 0
    model.train()
    while True:
        elapsed = time.monotonic() - start
        progress = step / args.steps if args.steps else elapsed / budget_s
        if progress >= 1.0:
            break
        warm = min(1.0, (step + 1) / args.warmup)
        cosine = 0.1 + 0.9 * 0.5 * (1.0 + math.cos(math.pi * progress))  # floor at 10% of peak
        for group in opt.param_groups:
            group["lr"] = args.lr * warm * cosine

        if cursor + args.batch_size > len(perm):  # new epoch, new shuffle
            perm = torch.randperm(len(train_data), generator=gen)
            cursor = 0
        batch = train_data[perm[cursor : cursor + args.batch_size]]
        cursor += args.batch_size

        loss = model(input_ids=batch, labels=batch).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()

        step += 1
        recent = (recent + [loss.item()])[-50:]
        if step % args.log_every == 0 or step == 1:
            epoch = step * args.batch_size / len(train_data)
            print(
                f"step {step:5d}  loss {loss.item():.4f}  avg50 {sum(recent) / len(recent):.4f}  "
                f"lr {opt.param_groups[0]['lr']:.2e}  epoch {epoch:.2f}  "
                f"{time.monotonic() - start:6.0f}s",
                flush=True,
            )
    elapsed = time.monotonic() - start
    print(f"trained {step} steps in {elapsed / 60:.1f} min "
          f"({step * args.batch_size * SEQ_LEN:,} tokens)", flush=True)
    return sum(recent) / len(recent)


# ----------------------------------------------------------------------------- main


def save(out: Path, model: Qwen3ForCausalLM, tok: PreTrainedTokenizerFast, eos_ids: list[int]) -> None:
    out.mkdir(parents=True, exist_ok=True)
    for stale in out.glob("*"):  # don't leave files from an earlier run behind
        if stale.is_file() and stale.name != "README.md":
            stale.unlink()
    model.generation_config = GenerationConfig(
        bos_token_id=eos_ids[0], eos_token_id=eos_ids, pad_token_id=eos_ids[0],
        do_sample=False, max_new_tokens=64,
    )
    n_bytes = sum(p.numel() for p in model.parameters()) * 4
    if n_bytes > 20 * 2**20:  # keep the package small
        model = model.to(torch.bfloat16)
    model.save_pretrained(out)
    # save_jinja_files=False keeps chat_template inside tokenizer_config.json, where
    # both older transformers and simple JSON readers (the server) find it.
    tok.save_pretrained(out, save_jinja_files=False)


def smoke_test(out: Path) -> None:
    model = AutoModelForCausalLM.from_pretrained(out)
    tok = AutoTokenizer.from_pretrained(out)
    model.eval()
    for prompt in ["The function returns", "A list is", "In Python, a class"]:
        ids = tok(prompt, return_tensors="pt").input_ids
        with torch.no_grad():
            gen = model.generate(ids, max_new_tokens=40, do_sample=False)
        print(f"--- {prompt!r}\n{tok.decode(gen[0], skip_special_tokens=True)!r}")
    chat = tok.apply_chat_template(
        [{"role": "user", "content": "hi"}], add_generation_prompt=True, tokenize=False
    )
    expected = "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    print(f"chat template: {chat!r}")
    assert chat == expected, chat
    text = "Unicode round-trip: naïve café — 日本語 ✓"
    assert tok.decode(tok(text).input_ids) == text
    print("chat template and byte-level round-trip OK")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--minutes", type=float, default=20.0, help="wall-clock training budget")
    p.add_argument("--steps", type=int, default=0, help="train for N steps instead of --minutes")
    p.add_argument("--out", type=Path, default=DEFAULT_OUT)
    p.add_argument("--vocab-size", type=int, default=4096)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--warmup", type=int, default=50)
    p.add_argument("--log-every", type=int, default=25)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args()

    random.seed(args.seed)
    torch.manual_seed(args.seed)
    torch.set_num_threads(args.threads)

    t0 = time.monotonic()
    docs = collect_corpus()
    print(f"corpus: {len(docs):,} documents, {sum(map(len, docs)):,} characters", flush=True)

    # Document-level split: every 50th document (2%) is held out.
    held_docs = docs[::50]
    train_docs = [d for i, d in enumerate(docs) if i % 50 != 0]

    tok = train_tokenizer(train_docs, args.vocab_size)
    eos_id = tok.convert_tokens_to_ids(EOS)
    im_end_id = tok.convert_tokens_to_ids(IM_END)
    print(f"tokenizer: vocab {len(tok)}, eos {eos_id}, im_end {im_end_id}", flush=True)

    # Encode with the raw backend: whole documents exceed model_max_length, which is fine here.
    encode = lambda ds: [e.ids for e in tok.backend_tokenizer.encode_batch(ds)]  # noqa: E731
    train_data = pack(encode(train_docs), eos_id)
    held_data = pack(encode(held_docs), eos_id)
    print(f"data: train {train_data.numel():,} tokens, held-out {held_data.numel():,} tokens "
          f"({time.monotonic() - t0:.0f}s preprocessing)", flush=True)

    model = build_model(len(tok), eos_id)
    n_params = sum(p.numel() for p in model.parameters())
    print(f"model: {n_params:,} parameters", flush=True)

    final_loss = train(args, model, train_data)
    held_loss = evaluate(model, held_data, args.batch_size)
    print(f"final train loss (avg last 50 steps): {final_loss:.4f}", flush=True)
    print(f"held-out loss: {held_loss:.4f} (ppl {math.exp(held_loss):.1f})", flush=True)

    save(args.out, model, tok, [eos_id, im_end_id])
    for f in sorted(args.out.iterdir()):
        print(f"  {f.name:28s} {f.stat().st_size:>12,} bytes")
    smoke_test(args.out)
    print(f"total time {(time.monotonic() - t0) / 60:.1f} min")


if __name__ == "__main__":
    main()
