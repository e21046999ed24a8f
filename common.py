"""The core a learner reads beside a script: sampling responses, their log-probs (the chunked output layer included),
decoding, a learned reward model's score, evaluation and metric pooling. No advantage estimator and no loss lives
here: each script holds its own algorithm. What a reader can skip lives elsewhere: the tasks and their verifiers in
tasks.py, and in plumbing/ several processes (dist), checkpoints and logs (run_state), model loading (models) and
argument checks (checks)."""

import math
import random
from contextlib import nullcontext

import torch
import torch.utils.checkpoint

from plumbing import dist, models


def seed_everything(seed: int) -> None:
    random.seed(seed)
    torch.manual_seed(seed)  # also seeds CUDA


def autocast(device: torch.device):
    """bf16 autocast on a GPU that supports it (parameters and optimizer state stay fp32); nothing on CPU."""
    if device.type == "cuda" and torch.cuda.is_bf16_supported():
        return torch.autocast("cuda", dtype=torch.bfloat16)
    return nullcontext()


# ---------------------------------------------------------------------------------------------------------------------
# Sampling: prompts in, completions out
# ---------------------------------------------------------------------------------------------------------------------


def tokenize_prompts(tokenizer, prompts: list[str], device: torch.device):
    """Left-padded prompt ids (B, P) and attention mask (B, P): every prompt ends in the last column."""
    enc = tokenizer(prompts, padding=True, padding_side="left", return_tensors="pt", add_special_tokens=False)
    return enc.input_ids.to(device), enc.attention_mask.to(device)


def eos_token_ids(model, tokenizer) -> list[int]:
    """Every id that ends a response: the tokenizer's EOS and those of the model's generation config (chat models
    often have several, e.g. an end-of-turn token besides end-of-text)."""
    ids = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    ids = ids if isinstance(ids, list) else [] if ids is None else [ids]
    return sorted({i for i in (tokenizer.eos_token_id, *ids) if i is not None})


def completion_mask(completion_ids: torch.Tensor, eos_ids) -> torch.Tensor:
    """(B, T) mask of valid completion tokens: every generated token up to and including the first EOS, nothing after.
    Built from EOS alone, so it stays right when a tokenizer uses the same id for padding and EOS."""
    is_eos = torch.isin(completion_ids, torch.as_tensor(eos_ids, device=completion_ids.device)).int()
    return (is_eos.cumsum(dim=1) - is_eos) == 0


@torch.no_grad()
def generate(
    model,
    tokenizer,
    prompt_ids,
    prompt_mask,
    max_new_tokens: int,
    temperature: float,
    stop_ids=(),
    done=None,
    return_logprobs=False,
):
    """Sample completions token by token with a KV cache. temperature > 0 samples from softmax(logits / temperature)
    with no top-k or top-p, so that the behaviour policy is exactly the one whose log-probs the scripts compute;
    temperature == 0 is greedy. A row ends at its first EOS, or at its first id of `stop_ids` (grpo_tools.py: where a
    tool call closes); rows marked in `done` (B,) are finished already and get only padding. Returns completion ids
    (B, T) (pad after the first EOS), mask (B, T), truncated (B,), and with `return_logprobs` the log-prob (B, T) each
    token was sampled with, from the logits this model computed in its own dtype (0 at padding; engines.py)."""
    from transformers import DynamicCache

    eos_ids = torch.tensor(eos_token_ids(model, tokenizer) + list(stop_ids), device=prompt_ids.device)
    pad_token_id = tokenizer.pad_token_id
    if not prompt_mask[:, -1].all():
        raise ValueError("generate needs left-padded prompts (see tokenize_prompts)")
    # the prompt pass, the longest, runs once per distinct prompt (a group's G copies share it); its cache is then copied
    distinct, rows = torch.unique(torch.cat([prompt_ids, prompt_mask], dim=1), dim=0, return_inverse=True)
    input_ids, attention_mask = distinct.split(prompt_ids.shape[1], dim=1)
    position_ids = (attention_mask.cumsum(dim=1) - 1).clamp(min=0)  # positions count from each row's first real token
    done = torch.zeros(len(prompt_ids), dtype=torch.bool) if done is None else done.clone()
    cache, done, tokens, logprobs = DynamicCache(), done.to(prompt_ids.device), [], []
    cache_argument = {models.kv_cache_argument(): cache}  # the keys and values of every position so far, appended each step
    for t in range(max_new_tokens):
        with autocast(prompt_ids.device):
            out = model(
                input_ids, attention_mask=attention_mask, position_ids=position_ids, logits_to_keep=1, **cache_argument
            )
        logits = out.logits[:, -1, :].float()  # (B, V)
        if t == 0:  # from the distinct prompts back to every row
            logits, attention_mask, position_ids = logits[rows], prompt_mask, position_ids[rows]
            cache.reorder_cache(rows)
        probs = torch.softmax(logits / temperature, dim=-1) if temperature > 0 else None
        finite = torch.isfinite(logits).all() and (probs is None or torch.isfinite(probs).all())
        if not dist.true_on_every_rank(finite):  # under torchrun every rank stops here, none waits for another
            raise SystemExit("non-finite logits while sampling: the model diverged, or --temperature is too small")
        next_token = torch.multinomial(probs, num_samples=1).squeeze(1) if temperature > 0 else logits.argmax(dim=-1)
        next_token = next_token.masked_fill(done, pad_token_id)  # (B,)
        if return_logprobs:  # log softmax(logits / temperature) at the sampled token, as completion_logprobs computes it
            all_logprobs = torch.log_softmax(logits / temperature, dim=-1) if temperature > 0 else torch.zeros_like(logits)
            logprobs.append(all_logprobs.gather(1, next_token[:, None]).squeeze(1).masked_fill(done, 0.0))  # greedy: 0
        tokens.append(next_token)
        done = done | torch.isin(next_token, eos_ids)
        if dist.true_on_every_rank(done.all()):  # under torchrun the ranks stop together (FSDP2 gathers weights every pass)
            break
        input_ids = next_token[:, None]
        attention_mask = torch.cat([attention_mask, torch.ones_like(input_ids)], dim=1)
        position_ids = position_ids[:, -1:] + 1
    completion_ids = torch.stack(tokens, dim=1)  # (B, T)
    truncated = ~torch.isin(completion_ids, eos_ids).any(dim=1)  # hit max_new_tokens without an EOS
    if return_logprobs:
        return completion_ids, completion_mask(completion_ids, eos_ids), truncated, torch.stack(logprobs, dim=1)
    return completion_ids, completion_mask(completion_ids, eos_ids), truncated


def decode(tokenizer, completion_ids: torch.Tensor, mask: torch.Tensor, truncated: torch.Tensor) -> list[str]:
    """The text of each completion: its valid tokens without the final EOS. Special tokens sampled inside an answer
    are kept (and make it wrong), rather than silently dropped."""
    lengths = (mask.sum(dim=1) - (~truncated).long()).tolist()  # drop the EOS of responses that ended
    return [tokenizer.decode(ids[:n], skip_special_tokens=False) for ids, n in zip(completion_ids.tolist(), lengths)]


def cat_padded(tensors: list[torch.Tensor], value=0, left: bool = False) -> torch.Tensor:
    """Concatenate (B_i, L_i) tensors along the batch, padding each to the longest L_i on the right (or the left).
    1-D tensors are concatenated as they are."""
    if tensors[0].dim() == 1:
        return torch.cat(tensors)
    width = max(t.shape[1] for t in tensors)
    out = torch.full((sum(len(t) for t in tensors), width), value, dtype=tensors[0].dtype, device=tensors[0].device)
    row = 0
    for t in tensors:
        columns = slice(width - t.shape[1], width) if left else slice(0, t.shape[1])
        out[row : row + len(t), columns] = t
        row += len(t)
    return out


# ---------------------------------------------------------------------------------------------------------------------
# Log-probs: log pi(y_t | x, y_<t) of the sampled tokens, the quantity every RL loss is built from
# ---------------------------------------------------------------------------------------------------------------------

# Entries of the (positions, vocabulary) logits computed at once: 2^24 floats, 64 MB in fp32 (110 positions at Qwen2.5's
# vocabulary of 151,936, the whole batch at the built-in model's 18 tokens).
LOGITS_CHUNK = 2**24

# Config fields of models whose forward transforms the logits after the output layer (Gemma 2's and Gemma 3n's
# softcapping, RecurrentGemma's soft cap, Cohere's and Granite's scaling, Falcon-H1's multiplier), read on the config and
# on its text config: completion_logprobs then uses the logits of the model's own forward, the whole (B, T, V) of them.
LOGIT_TRANSFORMS = ("final_logit_softcapping", "logits_soft_cap", "logit_scale", "logits_scaling", "lm_head_multiplier")


def transforms_logits(model) -> bool:
    """Whether the model's forward changes its logits after the output layer: a field of LOGIT_TRANSFORMS is set, or
    (checked once per model, at its first log-probs) the chunked output layer of completion_logprobs gives other
    log-probs than the model's own forward. Such a model's log-probs come from its own forward: sampling and scoring agree."""
    configs = (model.config, model.config.get_text_config())
    if any(getattr(config, name, None) for config in configs for name in LOGIT_TRANSFORMS):
        return True
    if not hasattr(model, "logits_transformed"):
        model.logits_transformed = False  # while the chunked output layer is checked against the model's forward
        model.logits_transformed = not chunked_output_layer_agrees(model)
    return model.logits_transformed


@torch.no_grad()
def chunked_output_layer_agrees(model) -> bool:
    """On 8 tokens: the log-probs of completion_logprobs' chunked output layer against those of the model's own logits."""
    head = model.get_output_embeddings().weight  # (V, H)
    ids = torch.arange(1, 9, device=head.device)[None] % head.shape[0]  # (1, 8)
    mask = torch.ones_like(ids)
    chunked, _ = completion_logprobs(model, ids, mask, 4, 1.0)  # (1, 4)
    with autocast(ids.device):
        logits = model(ids, attention_mask=mask, use_cache=False).logits[:, -5:-1].float()  # (1, 4, V)
    own = torch.log_softmax(logits, dim=-1).gather(-1, ids[:, -4:, None]).squeeze(-1)
    return torch.allclose(chunked, own, atol=1e-2)  # bf16 rounding on a GPU stays far below a transform's effect


def completion_logprobs(model, input_ids, attention_mask, completion_len: int, temperature: float, entropy_grad=False):
    """log pi(y_t | x, y_<t) of each of the last `completion_len` tokens of `input_ids`, computed from logits / temperature
    so that they are the log-probs of the distribution the tokens were sampled from. Returns logprobs (B, T) and the
    entropy of each of those next-token distributions (B, T; with a gradient only if `entropy_grad`). Positions run
    from each row's first real token, exactly as in `generate`.

    Memory: the logits of the whole pass, (B, T, V) in fp32, would be the largest tensor of a step at a real vocabulary,
    and a plain log_softmax and entropy hold several copies of them. They are never built here: the model's forward is
    asked for its final hidden states (and the logits of one position only), and the output layer then runs over
    LOGITS_CHUNK // V positions at a time. Without a gradient each chunk is freed before the next; with one, each chunk
    is recomputed in the backward pass instead of being kept (activation checkpointing of the output layer: one more
    pass through it). Either way one chunk's logits and their softmax temporaries are alive at a time."""

    def logprobs_and_entropy(logits, targets):  # (..., V), (...) -> log pi of the targets (...), entropy (...)
        all_logprobs = torch.log_softmax(logits.float() / temperature, dim=-1)  # (..., V)
        entropy = -(all_logprobs.exp() * all_logprobs).sum(dim=-1)
        return all_logprobs.gather(-1, targets[..., None]).squeeze(-1), entropy

    position_ids = (attention_mask.cumsum(dim=1) - 1).clamp(min=0)
    targets = input_ids[:, -completion_len:]  # (B, T)
    head = model.get_output_embeddings()  # the output layer: hidden state (H) -> logits (V)
    own_logits = head is None or transforms_logits(model)
    with autocast(input_ids.device):
        out = model(
            input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids,
            use_cache=False,
            logits_to_keep=completion_len + 1 if own_logits else 1,
            output_hidden_states=-1,  # the final hidden states (after the last norm) only, where the model can select
        )
    if own_logits:  # a model that transforms its logits: its own (B, T + 1, V), the last position predicting nothing
        logprobs, entropy = logprobs_and_entropy(out.logits[:, :-1], targets)
    else:
        hidden = out.hidden_states[-1][:, -completion_len - 1 : -1]  # (B, T, H): position t predicts completion token t
        hidden, flat_targets = hidden.reshape(-1, hidden.shape[-1]), targets.reshape(-1)  # (B T, H), (B T,)
        size = max(1, LOGITS_CHUNK // head.weight.shape[0])  # positions per chunk

        def chunk(h, y):  # (n, H), (n,) -> (n,), (n,): these n positions' logits are the only ones alive
            with autocast(h.device):
                logits = head(h)  # (n, V)
            return logprobs_and_entropy(logits, y)

        pieces = []
        for h, y in zip(hidden.split(size), flat_targets.split(size)):
            if torch.is_grad_enabled():  # recomputed in the backward pass rather than kept
                pieces.append(torch.utils.checkpoint.checkpoint(chunk, h, y, use_reentrant=False))
            else:
                pieces.append(chunk(h, y))
        logprobs, entropy = (torch.cat(x).view_as(targets) for x in zip(*pieces))
    return logprobs, entropy if entropy_grad and torch.is_grad_enabled() else entropy.detach()


@torch.no_grad()
def logprobs_no_grad(model, input_ids, attention_mask, completion_len: int, temperature: float, chunk_size: int):
    """completion_logprobs without gradient, `chunk_size` rows at a time (old and reference log-probs)."""
    chunks = zip(input_ids.split(chunk_size), attention_mask.split(chunk_size))
    return torch.cat([completion_logprobs(model, ids, mask, completion_len, temperature)[0] for ids, mask in chunks])


def sequence_rewards(model, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    """A reward model's score R(x, y) of each row (B,): its scalar head on the last layer's hidden state at the row's
    last real token (the EOS of a finished response, the last token of a truncated one). input_ids, attention_mask:
    (B, L) with the prompt left-padded and the completion right-padded, positions as in `generate`. We pick that token
    from the attention mask ourselves: the model's own pooling looks for pad_token_id, which would skip an EOS that
    doubles as the pad token. (A reward model is never sharded with FSDP2, so its body may be called on its own.)"""
    position_ids = (attention_mask.cumsum(dim=1) - 1).clamp(min=0)
    backbone = getattr(model, model.base_model_prefix)
    with autocast(input_ids.device):
        hidden = backbone(input_ids, attention_mask=attention_mask, position_ids=position_ids, use_cache=False)
    columns = torch.arange(input_ids.shape[1], device=input_ids.device)
    last = (columns * attention_mask).argmax(dim=1)  # (B,) the rightmost attended column
    pooled = hidden.last_hidden_state[torch.arange(len(input_ids), device=input_ids.device), last]  # (B, H)
    return model.score(pooled.to(model.score.weight.dtype)).squeeze(-1).float()


# ---------------------------------------------------------------------------------------------------------------------
# Evaluation and metrics
# ---------------------------------------------------------------------------------------------------------------------


@torch.no_grad()
def evaluate(
    model, tokenizer, task, max_new_tokens: int, eval_samples=0, temperature=1.0, dataset=None, batch_size=512, num_samples=4
) -> dict:
    """Greedy accuracy on the task's fixed held-out split (or on `dataset`), with the mean response length and, under
    "samples", what the model said to the first `num_samples` problems (to read, beside the score). With `eval_samples`
    N > 0, also eval/pass@k for k = 1, 2, 4, ... up to N (and N itself) from N responses sampled per problem at
    `temperature` (see sampled_pass_at_k). Under torchrun each rank answers its share of the problems and the scores
    are summed over the ranks."""
    dataset = task.eval if dataset is None else dataset
    was_training = model.training
    model.eval()
    device = next(model.parameters()).device
    correct, lengths, samples = [], [], []
    rows = torch.arange(len(dataset)).tensor_split(dist.world_size())[dist.rank()]  # under torchrun: this rank's share
    num_batches = math.ceil(math.ceil(len(dataset) / dist.world_size()) / batch_size)  # the same on every rank
    for part in rows.split(batch_size) if dist.world_size() == 1 else rows.tensor_split(num_batches):
        batch = dataset[part.tolist()]
        prompt_ids, prompt_mask = tokenize_prompts(tokenizer, batch["prompt"], device)
        ids, mask, truncated = generate(model, tokenizer, prompt_ids, prompt_mask, max_new_tokens, temperature=0.0)
        texts = decode(tokenizer, ids, mask, truncated)
        correct.append(task.verify(texts, batch["answer"]))
        lengths.append(mask.sum(dim=1).float().cpu())
        for i in range(min(num_samples - len(samples), len(texts))):  # the first problems, the same at every evaluation
            fed = tokenizer.decode(prompt_ids[i][prompt_mask[i].bool()])  # the prompt as the model saw it
            samples.append(
                {"prompt": fed, "completion": texts[i], "answer": batch["answer"][i], "reward": correct[-1][i].item()}
            )
    model.train(was_training)
    correct, lengths = torch.cat(correct).float(), torch.cat(lengths)
    if dist.world_size() > 1:  # every rank's problems: sums and counts over ranks
        sums = torch.stack([correct.sum(), lengths.sum(), torch.tensor(len(correct))]).double()
        total, length, count = dist.all_reduce(sums)
        correct, lengths = (total / count).view(1), (length / count).view(1)
    passes = sampled_pass_at_k(model, tokenizer, task, dataset, max_new_tokens, eval_samples, temperature, batch_size)
    return {
        "eval/accuracy": correct.mean().item(),
        "eval/response_length": lengths.mean().item(),
        **passes,
        "samples": samples,  # run_state.MetricsLogger writes these to samples.jsonl, not to metrics.jsonl
    }


def pass_at_k(num_correct: torch.Tensor, n: int, k: int) -> torch.Tensor:
    """The unbiased estimate of pass@k, the chance that at least one of k responses is correct, from n >= k sampled
    responses of which `num_correct` (per problem) are (Chen et al. 2021, Evaluating Large Language Models Trained on
    Code, §2.1): 1 - C(n - c, k) / C(n, k), the chance that k of the n drawn without replacement are all wrong. The
    ratio of binomials is the product over i < k of (n - c - i) / (n - i), a factor that reaches 0 (clamped there) when
    fewer than k wrong ones are left: no overflow for any n. Returns (P,) in float64."""
    wrong = n - num_correct.double()[:, None]  # (P, 1)
    i = torch.arange(k, dtype=torch.float64, device=wrong.device)  # (k,)
    return 1 - ((wrong - i) / (n - i)).clamp(min=0).prod(dim=1)


def pass_at_k_samples(num_correct: torch.Tensor, n: int) -> dict:
    """eval/pass@k for k = 1, 2, 4, ... up to n (and n itself), one sample per problem (P,) for pool_metrics, whose mean
    over the problems (of every rank) is the figure logged."""
    ks = sorted({2**j for j in range(n.bit_length())} | {n})
    return {f"eval/pass@{k}": pass_at_k(num_correct, n, k) for k in ks}


def sampled_pass_at_k(model, tokenizer, task, dataset, max_new_tokens, eval_samples, temperature, batch_size) -> dict:
    """eval/pass@k on `dataset`: each problem answered `eval_samples` times at `temperature`, pass_at_k of its count of
    correct answers, averaged over the problems."""
    if eval_samples == 0:
        return {}
    num_correct = sampled_correct_counts(
        model, tokenizer, task, dataset, max_new_tokens, eval_samples, temperature, batch_size
    )
    pooled = pool_metrics([pass_at_k_samples(num_correct, eval_samples)])  # under torchrun: every rank's
    return {name: value.item() for name, value in pooled.items()}


def sampled_correct_counts(model, tokenizer, task, dataset, max_new_tokens, n, temperature, batch_size) -> torch.Tensor:
    """How many of n answers sampled at `temperature` are correct, for each problem of `dataset` (under torchrun, of
    this rank's share): (P,). The sampling draws from a random stream of its own, seeded the same at every call, so that
    an evaluation leaves training exactly as it was."""
    device = next(model.parameters()).device
    rows = torch.arange(len(dataset)).tensor_split(dist.world_size())[dist.rank()]  # under torchrun: this rank's share
    per_batch = max(1, batch_size // n)  # problems per batch: about batch_size responses
    num_batches = math.ceil(math.ceil(len(dataset) / dist.world_size()) / per_batch)  # the same on every rank
    num_correct = []  # (P,) per batch
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        torch.manual_seed(dist.rank())  # every evaluation draws the same random numbers
        for part in rows.tensor_split(num_batches):
            batch = dataset[part.tolist()]
            prompts = [p for p in batch["prompt"] for _ in range(n)]  # each problem's answers contiguous
            answers = [a for a in batch["answer"] for _ in range(n)]
            prompt_ids, prompt_mask = tokenize_prompts(tokenizer, prompts, device)
            ids, mask, truncated = generate(model, tokenizer, prompt_ids, prompt_mask, max_new_tokens, temperature)
            correct = task.verify(decode(tokenizer, ids, mask, truncated), answers)  # (B,)
            num_correct.append(correct.view(-1, n).sum(dim=1))
    return torch.cat(num_correct)


def lengths_by_outcome(lengths: torch.Tensor, scores: torch.Tensor) -> dict:
    """Mean length in tokens of the correct responses (verifier score 1) and of the wrong ones, each logged only when
    the batch has one: whether wrong answers grow longer than right ones is what Dr. GRPO's length fix is about."""
    picks = {"rollout/response_length_correct": scores == 1, "rollout/response_length_wrong": scores != 1}
    return {name: lengths[pick].float() for name, pick in picks.items() if pick.any()}  # samples: the logger averages


def pool_metrics(rows: list[dict], min_max: tuple[str, ...] = ()) -> dict:
    """Combine the metrics of several micro-batches and optimizer steps (`rows`), and under torchrun of every rank. A
    metric is a tensor of samples (one per valid token for a token mean, one per response for a mean over responses, a
    scalar for a per-step number such as the gradient norm): the samples of every row and rank are pooled and their mean
    is logged, which weights each micro-batch by its tokens (or responses), so that no logged number depends on
    --micro-batch-size or on the number of processes. A metric NAME in `min_max` is also logged as NAME_min and NAME_max,
    the smallest and largest of its samples."""
    names = list(
        dict.fromkeys(k for ranks_names in dist.gather_objects([k for row in rows for k in row]) for k in ranks_names)
    )
    dtype = torch.float32 if dist.world_size() == 1 else torch.float64  # over ranks: exact for Python floats
    pooled = {}
    for name in names:  # every rank's metric names in one order (a rank may lack a metric that another has)
        pieces = [
            torch.as_tensor(dist.full_tensor(row[name]), dtype=dtype).detach().flatten().cpu() for row in rows if name in row
        ]
        pooled[name] = torch.cat(pieces) if pieces else torch.zeros(0, dtype=dtype)
    if not pooled:
        return {}
    samples = list(pooled.values())
    sums = dist.all_reduce(torch.stack([s.sum() for s in samples]))
    counts = dist.all_reduce(torch.tensor([float(len(s)) for s in samples], dtype=dtype))
    mins = dist.all_reduce(torch.stack([s.min() if len(s) else torch.tensor(math.inf, dtype=dtype) for s in samples]), "min")
    maxs = dist.all_reduce(torch.stack([s.max() if len(s) else torch.tensor(-math.inf, dtype=dtype) for s in samples]), "max")
    out = {}
    for i, name in enumerate(names):
        if counts[i] == 0:
            continue
        out[name] = sums[i] / counts[i]
        if name in min_max:
            out[f"{name}_min"], out[f"{name}_max"] = mins[i], maxs[i]
    return out


def check_finite(value: torch.Tensor, what: str, step: int) -> None:
    """Stop the run, saying where, instead of training on NaN or inf (under torchrun: every rank, when any rank has one)."""
    if not dist.true_on_every_rank(torch.isfinite(dist.full_tensor(value)).all()):
        raise SystemExit(f"non-finite {what} at step {step}: stopping (try a lower --learning-rate)")
