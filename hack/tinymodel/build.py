#!/usr/bin/env python3
"""Build kvferry's tiny test model folder, offline.

    python hack/tinymodel/build.py OUT_DIR

Writes into OUT_DIR:
  config.json              a copy of hack/tinymodel/config.json (Llama-shaped, 8 layers,
                           hidden 512, float32, vocab 8192, 4096 positions)
  tokenizer.json           byte-level BPE trained here on Python stdlib source
  tokenizer_config.json    PreTrainedTokenizerFast + bos/eos/pad + a ChatML chat template
                           that renders tools, documents and reasoning effort
  special_tokens_map.json
  generation_config.json
  model.safetensors        seeded random weights (134 MB float32), see below
  kvferry-tinymodel.json   provenance: corpus hash, python, tokenizers and torch versions

Why weights at all: vLLM's `--load-format dummy` draws every weight, norms included, from
U(-1e-3, 1e-3). With those the residual stream is the token embedding and attention adds
almost nothing, so the next token depends on the last token alone (seen here: every
answer was " up/ up/ up/ ..." whatever the prompt). Then a wrong KV cache gives the same
answer as the right one and "the answer equals the reference" proves nothing. The
weights written here are drawn N(0, 1) for the embeddings and N(0, 0.1) for every
projection, with RMSNorm weights 1: attention is sharp and the greedy answer changes
when 10 tokens 400 positions back change (checked with transformers, 800-token prompts).
Still random, still no download.

Needs `tokenizers`, `torch` and `safetensors` (the engine venv from hack/engine-env.sh
has them). Deterministic: the same Python, tokenizers and torch versions give the same
bytes (the corpus is a fixed, sorted list of the running interpreter's stdlib modules;
the weights come from a fixed seed on the CPU generator).
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
#
# The request options that change the prompt render the way real templates render
# them, so the engine tier can prove a turn carrying them does not reuse KV computed
# for another prompt (sidecar/allowlist.py): a system block first, when any is set,
# with the reasoning effort (gpt-oss: "Reasoning: high"), the tools as JSON lines in
# <tools> (Qwen3) and the documents (Command-R, Granite); and Qwen3's empty think
# block after the generation prompt when enable_thinking is false (vLLM sets it from
# reasoning_effort). vLLM passes the template only the variables it names, from
# chat_template_kwargs, the top-level documents / reasoning_effort and the tools. A
# request without them renders exactly as the plain ChatML template did.
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% set effort = reasoning_effort if reasoning_effort is defined else none %}"
    "{% if tools or documents or effort %}"
    "{{ '<|im_start|>system\\n' }}"
    "{% if effort %}{{ 'Reasoning: ' + effort|string + '\\n' }}{% endif %}"
    "{% if tools %}"
    "{{ '# Tools\\n<tools>' }}"
    "{% for tool in tools %}{{ '\\n' + tool|tojson }}{% endfor %}"
    "{{ '\\n</tools>\\n' }}"
    "{% endif %}"
    "{% if documents %}"
    "{{ '# Documents\\n' }}"
    "{% for doc in documents %}"
    "{{ 'Document: ' + loop.index0|string + '\\n' }}"
    "{% for key, value in doc.items() %}{{ key + ': ' + value|string + '\\n' }}{% endfor %}"
    "{% endfor %}"
    "{% endif %}"
    "{{ '<|im_end|>\\n' }}"
    "{% endif %}"
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
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}"
    "{% if enable_thinking is defined and enable_thinking is false %}"
    "{{ '<think>\\n\\n</think>\\n\\n' }}"
    "{% endif %}"
    "{% endif %}"
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


# Weight scales (see the module docstring) and the seed they are drawn with.
EMBED_STD = 1.0
PROJ_STD = 0.1
WEIGHTS_SEED = 0


def weight_shapes(config: dict) -> list[tuple[str, tuple[int, ...], str]]:
    """(name, shape, kind) of every LlamaForCausalLM weight, HF names, fixed order."""
    h, v, inter = config["hidden_size"], config["vocab_size"], config["intermediate_size"]
    heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
    head_dim = config.get("head_dim") or h // heads
    shapes = [("model.embed_tokens.weight", (v, h), "embed")]
    for i in range(config["num_hidden_layers"]):
        p = f"model.layers.{i}."
        shapes += [
            (p + "input_layernorm.weight", (h,), "norm"),
            (p + "self_attn.q_proj.weight", (heads * head_dim, h), "proj"),
            (p + "self_attn.k_proj.weight", (kv_heads * head_dim, h), "proj"),
            (p + "self_attn.v_proj.weight", (kv_heads * head_dim, h), "proj"),
            (p + "self_attn.o_proj.weight", (h, heads * head_dim), "proj"),
            (p + "post_attention_layernorm.weight", (h,), "norm"),
            (p + "mlp.gate_proj.weight", (inter, h), "proj"),
            (p + "mlp.up_proj.weight", (inter, h), "proj"),
            (p + "mlp.down_proj.weight", (h, inter), "proj"),
        ]
    shapes += [("model.norm.weight", (h,), "norm"), ("lm_head.weight", (v, h), "proj")]
    return shapes


def write_weights(config: dict, path: Path) -> str:
    """Seeded random weights as safetensors; returns the torch version used."""
    import torch
    from safetensors.torch import save_file

    gen = torch.Generator().manual_seed(WEIGHTS_SEED)
    tensors = {}
    for name, shape, kind in weight_shapes(config):
        if kind == "norm":
            t = torch.ones(shape, dtype=torch.float32)
        else:
            std = EMBED_STD if kind == "embed" else PROJ_STD
            t = torch.empty(shape, dtype=torch.float32).normal_(0.0, std, generator=gen)
        tensors[name] = t
    save_file(tensors, str(path), metadata={"format": "pt"})
    return torch.__version__


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
    torch_version = write_weights(config, out / "model.safetensors")
    dump(
        "kvferry-tinymodel.json",
        {
            "python": sys.version.split()[0],
            "tokenizers": tokenizers_version,
            "torch": torch_version,
            "weights": {"seed": WEIGHTS_SEED, "embed_std": EMBED_STD, "proj_std": PROJ_STD},
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
