#!/usr/bin/env python3
"""Build kvferry's tiny test model folder, offline.

    python hack/tinymodel/build.py OUT_DIR

Writes into OUT_DIR:
  config.json              a copy of hack/tinymodel/config.json (Llama-shaped, 8 layers,
                           hidden 512, float32, vocab 8192, 4096 positions)
  tokenizer.json           byte-level BPE trained here on Python stdlib source
  tokenizer_config.json    PreTrainedTokenizerFast + bos/eos/pad + a ChatML chat template
  special_tokens_map.json
  generation_config.json
  kvferry-tinymodel.json   provenance: corpus hash, python and tokenizers versions

There are no weights: vLLM serves it with `--load-format dummy` (random weights), which
is all the engine tests need (KV transfer, prefix caching, greedy determinism).

Needs the `tokenizers` package (the engine venv from hack/engine-env.sh has it).
Deterministic: the same Python version and tokenizers version give the same bytes (the
corpus is a fixed, sorted list of the running interpreter's stdlib modules).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import sys
import sysconfig
from pathlib import Path

# One trainer thread: byte-identical output on every run.
os.environ.setdefault("RAYON_RS_NUM_CPUS", "1")
os.environ.setdefault("RAYON_NUM_THREADS", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

HERE = Path(__file__).resolve().parent

PAD, BOS, EOS, IM_START = "<|pad|>", "<|begin_of_text|>", "<|im_end|>", "<|im_start|>"
SPECIAL_TOKENS = [PAD, BOS, EOS, IM_START]  # ids 0..3, matching config.json

# ChatML. bos comes from the template (vLLM tokenizes a rendered chat prompt without
# adding special tokens); plain completion prompts get bos from the post-processor.
# Content given as OpenAI parts is joined from its text parts.
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' }}"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% elif message['content'] is not none %}"
    "{% for part in message['content'] %}"
    "{% if part['type'] == 'text' %}{{ part['text'] }}{% endif %}"
    "{% endfor %}"
    "{% endif %}"
    "{{ '<|im_end|>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

# Stdlib modules used as training text: long-lived, plain-text heavy. Missing ones are
# skipped (the provenance file records exactly what was used).
CORPUS_MODULES = [
    "argparse.py",
    "ast.py",
    "asyncio",
    "calendar.py",
    "collections",
    "configparser.py",
    "csv.py",
    "dataclasses.py",
    "datetime.py",
    "decimal.py",
    "difflib.py",
    "email",
    "enum.py",
    "fractions.py",
    "ftplib.py",
    "functools.py",
    "gettext.py",
    "heapq.py",
    "http",
    "imaplib.py",
    "inspect.py",
    "json",
    "logging",
    "mailbox.py",
    "os.py",
    "pathlib.py",
    "pickle.py",
    "pydoc.py",
    "random.py",
    "shutil.py",
    "smtplib.py",
    "statistics.py",
    "string.py",
    "subprocess.py",
    "tarfile.py",
    "textwrap.py",
    "threading.py",
    "typing.py",
    "unittest",
    "urllib",
    "uuid.py",
    "zipfile",
]
CORPUS_MAX_BYTES = 6 * 1024 * 1024


def corpus_files() -> list[Path]:
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    files: list[Path] = []
    for name in CORPUS_MODULES:
        p = stdlib / name
        if p.is_file():
            files.append(p)
        elif p.is_dir():
            files.extend(sorted(f for f in p.rglob("*.py") if "test" not in f.parts))
    return files


def corpus(files: list[Path]) -> tuple[list[str], str]:
    texts, total, h = [], 0, hashlib.sha256()
    for f in files:
        t = f.read_text(encoding="utf-8", errors="replace")
        if total + len(t) > CORPUS_MAX_BYTES:
            break
        texts.append(t)
        total += len(t)
        h.update(t.encode("utf-8"))
    return texts, h.hexdigest()


def build(out: Path) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from tokenizers import __version__ as tokenizers_version

    config = json.loads((HERE / "config.json").read_text())
    vocab_size = int(config["vocab_size"])

    texts, corpus_sha = corpus(corpus_files())
    if not texts:
        raise SystemExit("build.py: no training text found in the stdlib")

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer, length=len(texts))
    for i, t in enumerate(SPECIAL_TOKENS):
        assert tok.token_to_id(t) == i, f"{t} has id {tok.token_to_id(t)}, want {i}"
    got = tok.get_vocab_size(with_added_tokens=True)
    if got != vocab_size:
        raise SystemExit(f"build.py: tokenizer has {got} tokens, config.json says {vocab_size}")
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A",
        pair=f"{BOS} $A {BOS} $B",
        special_tokens=[(BOS, SPECIAL_TOKENS.index(BOS))],
    )

    out.mkdir(parents=True, exist_ok=True)
    tok.save(str(out / "tokenizer.json"), pretty=True)
    shutil.copyfile(HERE / "config.json", out / "config.json")

    def dump(name: str, obj: dict) -> None:
        (out / name).write_text(json.dumps(obj, indent=2, sort_keys=True) + "\n")

    dump(
        "tokenizer_config.json",
        {
            "tokenizer_class": "PreTrainedTokenizerFast",
            "bos_token": BOS,
            "eos_token": EOS,
            "pad_token": PAD,
            "add_bos_token": True,
            "add_eos_token": False,
            "model_max_length": int(config["max_position_embeddings"]),
            "clean_up_tokenization_spaces": False,
            "chat_template": CHAT_TEMPLATE,
            "added_tokens_decoder": {
                str(i): {
                    "content": t,
                    "lstrip": False,
                    "normalized": False,
                    "rstrip": False,
                    "single_word": False,
                    "special": True,
                }
                for i, t in enumerate(SPECIAL_TOKENS)
            },
        },
    )
    dump(
        "special_tokens_map.json",
        {
            "bos_token": BOS,
            "eos_token": EOS,
            "pad_token": PAD,
            "additional_special_tokens": [IM_START],
        },
    )
    dump(
        "generation_config.json",
        {
            "bos_token_id": config["bos_token_id"],
            "eos_token_id": config["eos_token_id"],
            "pad_token_id": config["pad_token_id"],
        },
    )
    dump(
        "kvferry-tinymodel.json",
        {
            "python": sys.version.split()[0],
            "tokenizers": tokenizers_version,
            "corpus_sha256": corpus_sha,
            "corpus_files": len(texts),
            "vocab_size": vocab_size,
        },
    )


def main(argv: list[str]) -> int:
    if len(argv) != 2 or argv[1].startswith("-"):
        print(__doc__, file=sys.stderr)
        return 2
    build(Path(argv[1]))
    print(argv[1])
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
