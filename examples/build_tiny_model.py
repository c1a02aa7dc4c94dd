"""Build a tiny random Llama that vLLM CPU can serve, entirely offline.

No weights can be downloaded on the machines this project is tested on, so
the end-to-end tests, the demo and the benchmarks serve this model instead.
Its text is gibberish; what matters is that it has a real architecture,
tokenizer and chat template, so the OpenAI server runs its normal code paths
and decodes hundreds of tokens per second on two CPU cores.

Usage::

    python examples/build_tiny_model.py [--out models/tiny-llama] [--force]

The build is deterministic (fixed seeds) and idempotent: a ``.complete``
marker, written last, records the builder's fingerprint, and a directory that
holds a matching marker is reused as is.
"""

from __future__ import annotations

import argparse
import fcntl
import hashlib
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
DEFAULT_OUT = REPO_ROOT / "models" / "tiny-llama"
MARKER = ".complete"
SEED = 1234

# Bump when the model or tokenizer recipe changes, so old builds are rebuilt.
BUILDER_VERSION = 1

# head_dim 64 is deliberate: the CPU attention backend rejects small head
# sizes ("Unsupported CPU attention configuration" with head_dim 16).
MODEL_CONFIG: dict[str, object] = {
    "hidden_size": 128,
    "intermediate_size": 256,
    "num_hidden_layers": 2,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "head_dim": 64,
    "max_position_embeddings": 2048,
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
    "tie_word_embeddings": False,
}
VOCAB_SIZE = 512
SPECIAL_TOKENS = ["<|pad|>", "<|bos|>", "<|eos|>", "<|user|>", "<|assistant|>", "<|system|>"]

# A plain-text template: the tokenizer is byte-level, so the role markers are
# ordinary special tokens and any message content encodes.
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{{ '<|' + message['role'] + '|>' }}{{ message['content'] }}{{ eos_token }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>' }}{% endif %}"
)

TRAINING_TEXT = [
    "One vLLM engine serves many users at the same time.",
    "A user who opens many concurrent streams takes most decode slots.",
    "outrate limits output tokens per second per user inside the scheduler.",
    "Operators write the limits as YAML policies and lint them before deploy.",
    "The quick brown fox jumps over the lazy dog 0123456789 times.",
    "Rate limiting with GCRA paces requests evenly instead of in bursts.",
    "Hello, world! How are you today? I am fine, thank you very much.",
    "def schedule(self): return [request for request in self.running]",
    "Tokens, prompts, completions, streams, budgets, bursts and refunds.",
    "The cat sat on the mat; the dog ran in the park; birds sang in trees.",
]


def fingerprint() -> str:
    """Identify the recipe, so a changed builder never reuses a stale build."""
    recipe = {
        "version": BUILDER_VERSION,
        "seed": SEED,
        "config": MODEL_CONFIG,
        "vocab": VOCAB_SIZE,
        "special": SPECIAL_TOKENS,
        "template": CHAT_TEMPLATE,
        "text": TRAINING_TEXT,
    }
    blob = json.dumps(recipe, sort_keys=True).encode()
    return hashlib.sha256(blob).hexdigest()[:16]


def is_complete(out_dir: Path) -> bool:
    marker = out_dir / MARKER
    try:
        return json.loads(marker.read_text())["fingerprint"] == fingerprint()
    except (OSError, ValueError, KeyError):
        return False


def _train_tokenizer():  # -> PreTrainedTokenizerFast
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    # ByteLevel with the full initial alphabet: every byte is a token, so any
    # text (unicode, code, long prompts) encodes without unknown tokens.
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(TRAINING_TEXT * 4, trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<|bos|>",
        eos_token="<|eos|>",
        pad_token="<|pad|>",
        clean_up_tokenization_spaces=False,
        model_max_length=int(MODEL_CONFIG["max_position_embeddings"]),  # type: ignore[arg-type]
    )
    fast.chat_template = CHAT_TEMPLATE
    return fast


def _build_into(tmp: Path) -> None:
    import torch
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

    tokenizer = _train_tokenizer()
    tokenizer.save_pretrained(tmp)

    torch.manual_seed(SEED)
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        torch_dtype="bfloat16",
        **MODEL_CONFIG,
    )
    model = LlamaForCausalLM(config).to(torch.bfloat16).eval()
    model.save_pretrained(tmp, safe_serialization=True)
    GenerationConfig(
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    ).save_pretrained(tmp)


def build(out_dir: Path = DEFAULT_OUT, force: bool = False) -> Path:
    """Build the model into ``out_dir``, or reuse a complete build there.

    Safe to call from several processes at once (tests run in parallel): a
    lock file beside ``out_dir`` serialises builders, and the directory only
    appears, complete, by a rename.
    """
    out_dir = Path(out_dir).resolve()
    if not force and is_complete(out_dir):
        print(f"reusing tiny model at {out_dir}")
        return out_dir

    os.environ["HF_HUB_OFFLINE"] = "1"
    os.environ["TRANSFORMERS_OFFLINE"] = "1"
    os.environ["HF_HUB_DISABLE_PROGRESS_BARS"] = "1"
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

    out_dir.parent.mkdir(parents=True, exist_ok=True)
    lock_path = out_dir.parent / f".{out_dir.name}.lock"
    with open(lock_path, "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not force and is_complete(out_dir):  # another process built it meanwhile
            print(f"reusing tiny model at {out_dir}")
            return out_dir
        start = time.monotonic()
        tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}-", dir=out_dir.parent))
        try:
            _build_into(tmp)
            marker = {"fingerprint": fingerprint(), "builder_version": BUILDER_VERSION}
            (tmp / MARKER).write_text(json.dumps(marker) + "\n")
            tmp.chmod(0o755)  # mkdtemp makes it 0700
            if out_dir.exists():
                shutil.rmtree(out_dir)
            tmp.rename(out_dir)
        finally:
            if tmp.exists():
                shutil.rmtree(tmp, ignore_errors=True)
    print(f"built tiny model at {out_dir} in {time.monotonic() - start:.1f} s")
    return out_dir


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="output directory")
    parser.add_argument("--force", action="store_true", help="rebuild even if complete")
    args = parser.parse_args(argv)
    build(args.out, force=args.force)
    return 0


if __name__ == "__main__":
    sys.exit(main())
