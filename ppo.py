"""PPO: proximal policy optimisation with a learned critic and GAE (Schulman et al. 2017; GAE, Schulman et al. 2015).

The language-model form of InstructGPT (Ouyang et al. 2022): the behaviour policy samples one response per prompt;
every response token gets the reward -beta * (log pi_old - log pi_ref), and the last one also gets the task's score.
A critic, initialised from the warm-up policy with a scalar head, predicts the value of every prefix; GAE turns
rewards and values into per-token advantages, which are whitened and plugged into the clipped surrogate for several
epochs of minibatch updates, while the critic regresses onto the lambda-returns.

    python ppo.py

Departures from the papers:
1. The reward is a verifier (1 correct, 0 wrong) at the last response token unless --reward-model or --reward-funcs
   say, and the reference model is the warm-up policy, never reset.
2. Truncation at max_new_tokens is termination (V = 0 after the last token): a truncated answer is scored as final.
3. The KL coefficient beta is fixed (no adaptive controller); the value loss is not clipped by default (see Args).
4. The critic is a separate network with its own learning rate; the actor and critic losses are summed, but share no
   parameters. Gradients are clipped per network; AdamW without weight decay.
"""

import os
import random
import time
from dataclasses import dataclass

import torch
import tyro
from tqdm import tqdm

import common
import reward_funcs
import tasks
from plumbing import checks, dist, lora, models, run_state

TOTAL_STEPS = 60  # PPO: fewer, costlier steps (default --total-steps; halved on the scratchpad task, as in grpo.py)


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
    num_prompts: int = 256
    """prompts per rollout"""
    group_size: int = 1
    """responses per prompt (PPO needs no group: the critic is the baseline)"""
    num_minibatches: int = 4
    """minibatches per rollout batch, one optimizer step each"""
    num_epochs: int = 2
    """passes over the rollout batch (mu in the GRPO paper, K epochs in PPO's)"""
    micro_batch_size: int = 0
    """responses per forward/backward pass, for memory (0: the whole minibatch); does not change the gradient"""
    learning_rate: float = 0.0
    """AdamW learning rate of the policy (0: 1e-4 for the built-in model, 1e-6 for a pretrained one)"""
    max_grad_norm: float = 1.0
    """gradient clipping threshold"""
    temperature: float = 1.0
    """sampling temperature; log-probs are computed from logits / temperature to match"""
    max_new_tokens: int = 0
    """generation budget per response (0: the task's own, 8 for addition and 64 for scratchpad)"""
    clip_eps: float = 0.2
    """PPO clip range epsilon"""
    beta: float = 0.05
    """coefficient of the per-token KL penalty in the reward (0: no reference model is loaded)"""
    critic_learning_rate: float = 0.0
    """AdamW learning rate of the critic (0: 3e-4 for the built-in model, 1e-5 for a pretrained one)"""
    gamma: float = 1.0
    """discount; 1 for episodic text generation"""
    lam: float = 0.95
    """GAE lambda: 0 is the one-step TD residual, 1 the Monte Carlo return minus the value"""
    whiten_advantages: bool = True
    """standardise the advantages over the valid tokens of the batch (the returns are formed before this)"""
    value_clip_eps: float = 0.0
    """clip the value prediction to old value +- this in the value loss (0: off: a fresh critic must move far)"""
    entropy_coef: float = 0.0
    """coefficient of the entropy bonus"""
    target_kl: float = 0.0
    """stop the epochs of a rollout once the approximate KL to the behaviour policy exceeds this (0: never)"""

    def __post_init__(self):
        self.output_dir = self.output_dir or f"runs/{self.exp_name}__{self.seed}"
        self.batch_size = self.num_prompts * self.group_size // dist.world_size()  # responses per rollout and process
        self.minibatch_size = self.batch_size // max(1, self.num_minibatches)
        self.micro_batch_size = self.micro_batch_size or self.minibatch_size
        self.learning_rate = self.learning_rate or (1e-4 if self.model_name_or_path == "builtin" else 1e-6)
        self.critic_learning_rate = self.critic_learning_rate or (3e-4 if self.model_name_or_path == "builtin" else 1e-5)


def check_args(args: Args) -> None:
    """Fail fast with the flag's name, before any expensive work."""
    tasks.check_task_flag(args)
    checks.rl_flags(args)
    checks.flag(args, "group_size", "must be at least 1", lambda v: v >= 1)
    checks.flag(args, "clip_eps", "must be in (0, 1): the ratio is clipped to [1 - eps, 1 + eps]", lambda v: 0 < v < 1)
    if args.batch_size % args.num_minibatches or args.minibatch_size % args.micro_batch_size:
        raise SystemExit(
            f"--num-prompts x --group-size ({args.batch_size}) must split into --num-minibatches ({args.num_minibatches}) "
            f"minibatches, and each minibatch ({args.minibatch_size}) into --micro-batch-size ({args.micro_batch_size})"
        )
    for flag in ("gamma", "lam"):  # PPO: discount and GAE lambda
        checks.flag(args, flag, "must be in [0, 1]", lambda v: 0 <= v <= 1)
    checks.flag(args, "critic_learning_rate", "must be positive", lambda v: v > 0)  # PPO: the critic
    for flag in ("value_clip_eps", "entropy_coef", "target_kl"):  # PPO: 0 turns each off
        checks.flag(args, flag, "must be 0 (off) or positive", lambda v: v >= 0)
    checks.output_folders(args)


# ---------------------------------------------------------------------------------------------------------------------
# Algorithm: reward, advantage and losses (pure functions of tensors)
# ---------------------------------------------------------------------------------------------------------------------


def compute_rewards(scores, logprobs, ref_logprobs, mask, args):
    """Per-token rewards (N, T): r_t = -beta * (log pi_old - log pi_ref) at every response token, plus the task score
    at the last response token (Ouyang et al. 2022, eq. 2). logprobs are the behaviour policy's, so the
    penalty is fixed at rollout time. scores: (N,); logprobs, ref_logprobs, mask: (N, T). Zero on padding."""
    rewards = -args.beta * (logprobs - ref_logprobs) if args.beta > 0 else torch.zeros(mask.shape, device=mask.device)
    last = mask.sum(dim=1) - 1  # (N,) index of the last valid token (EOS, or the last token of a truncated response)
    rewards = rewards.scatter_add(1, last[:, None], scores[:, None].to(rewards.dtype))
    return torch.where(mask, rewards, 0.0)


def compute_gae(rewards, values, mask, args):
    """GAE (Schulman et al. 2015, eq. 16), computed backward: delta_t = r_t + gamma V_{t+1} - V_t and
    A_t = delta_t + gamma lambda A_{t+1}, with V = 0 and A = 0 after the last valid token. Truncation is treated as
    termination here (see the module docstring). Returns advantages and returns R_t = A_t + V_t (the lambda-return,
    before any whitening), both (N, T) and zero on padding. Values on padding are ignored."""
    values = torch.where(mask, values, 0.0)  # whatever the critic says on padding does not enter
    rewards = torch.where(mask, rewards, 0.0)
    advantages = torch.zeros_like(rewards)
    next_value, next_advantage = torch.zeros_like(rewards[:, 0]), torch.zeros_like(rewards[:, 0])
    for t in reversed(range(rewards.shape[1])):
        delta = rewards[:, t] + args.gamma * next_value - values[:, t]
        next_advantage = delta + args.gamma * args.lam * next_advantage
        advantages[:, t] = next_advantage
        next_value = values[:, t]
    advantages = torch.where(mask, advantages, 0.0)
    return advantages, advantages + values


def compute_policy_loss(logprobs, old_logprobs, advantages, mask, args, num_tokens=None):
    """Negative clipped surrogate (PPO eq. 7), per token, averaged over all valid tokens of the minibatch.

    logprobs, old_logprobs, advantages, mask: (N, T). With `num_tokens` (the minibatch's valid-token count) a
    micro-batch returns its share of the minibatch's loss, so that micro-batches add up to the minibatch's token mean."""
    log_ratio = torch.where(mask, logprobs - old_logprobs, 0.0)  # (N, T) masked before exp: padding cannot overflow
    ratio = torch.exp(log_ratio)  # (N, T) pi_theta / pi_old of each sampled token (PPO, Schulman 2017, §3)
    adv = advantages  # (N, T) PPO: one advantage per token, from GAE
    low, high = 1 - args.clip_eps, 1 + args.clip_eps  # the clip range of the ratio
    pg_loss = -torch.min(ratio * adv, torch.clamp(ratio, low, high) * adv)  # (N, T)
    total = torch.where(mask, pg_loss, 0.0).sum() / (num_tokens or mask.sum().clamp(min=1))  # PPO: token mean

    with torch.no_grad():  # samples, one per valid token or per response, pooled over micro-batches by common.pool_metrics
        metrics = {
            "loss/policy": pg_loss[mask],  # PPO: one sample per token
            "train/ratio": ratio[mask],  # logged as its mean, and its min and max (see the log section)
            "train/clip_frac_low": ((ratio < low) & (adv < 0))[mask].float(),
            "train/clip_frac_high": ((ratio > high) & (adv > 0))[mask].float(),
            "kl/old_approx": (torch.exp(log_ratio) - 1 - log_ratio)[mask],  # k3 of KL(pi_old || pi_theta), per token
        }
    return total, metrics


def compute_value_loss(values, old_values, returns, mask, args, num_tokens=None):
    """0.5 (V - R)^2 averaged over valid tokens (PPO eq. 9, L^VF); with value_clip_eps > 0, the larger of
    that and 0.5 (V_clipped - R)^2, V_clipped = V_old + clip(V - V_old, -eps, eps). values, old_values, returns, mask:
    (N, T); returns and old values are constants. `num_tokens` as in compute_policy_loss."""
    loss = 0.5 * (values - returns) ** 2  # (N, T)
    if args.value_clip_eps > 0:
        clipped = old_values + torch.clamp(values - old_values, -args.value_clip_eps, args.value_clip_eps)
        loss = torch.max(loss, 0.5 * (clipped - returns) ** 2)
    total = torch.where(mask, loss, 0.0).sum() / (num_tokens or mask.sum().clamp(min=1))
    with torch.no_grad():
        clip_frac = ((values - old_values).abs() > args.value_clip_eps).float()[mask] if args.value_clip_eps > 0 else 0.0
        metrics = {"loss/value": loss[mask], "train/value_clip_frac": clip_frac}
    return total, metrics


class Critic(torch.nn.Module):
    """V(s_t) for every response position: the warm-up model's transformer body with a scalar head (zero-initialised,
    so that the first values are 0). The value of the prefix (x, y_<t) is read where the policy reads y_t's logits."""

    def __init__(self, args, dtype):
        super().__init__()
        body = models.load_body(args.model_name_or_path, args.cache_dir, args.task, dtype)  # the warm-up model's body
        self.body = lora.add_adapter(body, args) if args.lora_rank else body  # --lora-rank: an adapter of its own
        self.head = torch.nn.Linear(self.body.config.hidden_size, 1)  # trained whole, in fp32
        torch.nn.init.zeros_(self.head.weight)
        torch.nn.init.zeros_(self.head.bias)

    def forward(self, input_ids, attention_mask, completion_len: int):
        position_ids = (attention_mask.cumsum(dim=1) - 1).clamp(min=0)
        with common.autocast(input_ids.device):
            out = self.body(input_ids, attention_mask=attention_mask, position_ids=position_ids, use_cache=False)
        return self.head(out.last_hidden_state[:, -completion_len - 1 : -1].float()).squeeze(-1)  # (B, T)


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
    critic = dist.prepare_models(args, Critic(args, lora.base_dtype(args, device)).to(device))[0]  # PPO: under torchrun too
    # models stay in eval mode throughout: no dropout, so that on-policy the ratio is exactly 1
    param_groups = [{"params": policy.parameters()}, {"params": critic.parameters(), "lr": args.critic_learning_rate}]
    optimizer = torch.optim.AdamW(param_groups, lr=args.learning_rate, weight_decay=0.0)  # PPO: the actor and the critic
    rng = random.Random(args.seed)
    checkpoint = run_state.Checkpoint(args, optimizer, rng)  # with --resume: the weights, optimizer, RNGs and step saved last
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
        # Rollout: responses from the frozen behaviour policy pi_old, with their old log-probs and old values
        # -------------------------------------------------------------------------------------------------------------
        step_start = time.time()
        batch = task.train[dist.shard(rng.sample(range(len(task.train)), args.num_prompts))]
        prompts = [p for p in batch["prompt"] for _ in range(args.group_size)]  # each group is contiguous
        answers = [a for a in batch["answer"] for _ in range(args.group_size)]
        prompt_ids, prompt_mask = common.tokenize_prompts(tokenizer, prompts, device)  # (B, P)
        completion_ids, mask, truncated = common.generate(
            policy, tokenizer, prompt_ids, prompt_mask, args.max_new_tokens, args.temperature
        )  # (B, T), (B, T) through the first EOS, (B,)
        input_ids = torch.cat([prompt_ids, completion_ids], dim=1)
        attention_mask = torch.cat([prompt_mask, mask.long()], dim=1)
        T = completion_ids.shape[1]
        # with one optimizer step per rollout the policy is still pi_old when the loss is computed: the old log-probs
        # are then the current ones detached, and a separate forward pass would be wasted work
        on_policy = args.num_minibatches == 1 and args.num_epochs == 1
        old_logprobs, ref_logprobs = None, None  # (B, T) each, no gradient
        if not on_policy or args.beta > 0:  # PPO: the KL reward needs pi_old's log-probs before any update
            old_logprobs = common.logprobs_no_grad(
                policy, input_ids, attention_mask, T, args.temperature, args.micro_batch_size
            )
        if args.beta > 0:
            ref_logprobs = common.logprobs_no_grad(
                ref_policy, input_ids, attention_mask, T, args.temperature, args.micro_batch_size
            )
        with torch.no_grad():  # PPO: the old values
            chunks = zip(input_ids.split(args.micro_batch_size), attention_mask.split(args.micro_batch_size))
            old_values = torch.cat([critic(ids, att, T) for ids, att in chunks])  # (B, T) V_old(s_t)

        # -------------------------------------------------------------------------------------------------------------
        # Reward: the task's score at the last token and the KL penalty at every token; the score is the verifier's, or
        # --reward-model's score, or --reward-funcs' weighted sum; the verifier then stays the gold measure, logged only
        # -------------------------------------------------------------------------------------------------------------
        completions = common.decode(tokenizer, completion_ids, mask, truncated)  # (B,) texts
        gold = task.verify(completions, answers).to(device)  # (B,) 1 correct, 0 wrong
        rewards, reward_scores = reward_functions(batch, completions, gold, input_ids, attention_mask)  # (B,), (B, F)
        token_rewards = compute_rewards(rewards, old_logprobs, ref_logprobs, mask, args)  # (B, T) PPO: per token

        # -------------------------------------------------------------------------------------------------------------
        # Advantage: GAE from the rewards and the old values; returns before whitening
        # -------------------------------------------------------------------------------------------------------------
        advantages, returns = compute_gae(token_rewards, old_values, mask, args)  # (B, T) each, PPO: GAE per token
        raw_advantages = dist.concat_over_ranks(advantages[mask])  # PPO: the valid tokens of every rank
        if args.whiten_advantages:  # PPO: over the valid tokens of the whole batch
            advantages = torch.where(mask, (advantages - raw_advantages.mean()) / (raw_advantages.std() + 1e-8), 0.0)
        rollout_time = time.time() - step_start

        # -------------------------------------------------------------------------------------------------------------
        # Update: num_epochs passes over num_minibatches minibatches, one optimizer step each (actor and critic)
        # -------------------------------------------------------------------------------------------------------------
        train_metrics, stop = [], False  # PPO: stop is the early stop on --target-kl
        for _ in range(args.num_epochs):
            for mb_idx in torch.randperm(args.batch_size, device=device).split(args.minibatch_size):
                optimizer.zero_grad()
                num_tokens = dist.global_count_per_rank(mask[mb_idx].sum())  # PPO: token mean over the minibatch, all ranks
                for idx in mb_idx.split(args.micro_batch_size):
                    logprobs, entropy = common.completion_logprobs(
                        policy, input_ids[idx], attention_mask[idx], T, args.temperature, args.entropy_coef > 0
                    )  # (b, T) each
                    micro_old_logprobs = logprobs.detach() if on_policy else old_logprobs[idx]
                    pg_loss, metrics = compute_policy_loss(
                        logprobs, micro_old_logprobs, advantages[idx], mask[idx], args, num_tokens
                    )
                    values = critic(input_ids[idx], attention_mask[idx], T)  # (b, T) PPO: the critic's update
                    value_loss, value_metrics = compute_value_loss(
                        values, old_values[idx], returns[idx], mask[idx], args, num_tokens
                    )
                    entropy_bonus = torch.where(mask[idx], entropy, 0.0).sum() / num_tokens
                    loss = pg_loss + value_loss - args.entropy_coef * entropy_bonus  # PPO: actor, critic and entropy
                    common.check_finite(loss, "loss", step)
                    loss.backward()
                    metrics.update(value_metrics)
                    metrics["train/entropy"] = entropy[mask[idx]]
                    train_metrics.append(metrics)
                dist.average_gradients(optimizer)  # under torchrun: every gradient becomes its mean over the processes
                grad_norm = torch.nn.utils.clip_grad_norm_(policy.parameters(), args.max_grad_norm)
                common.check_finite(grad_norm, "gradient norm", step)
                critic_grad_norm = torch.nn.utils.clip_grad_norm_(critic.parameters(), args.max_grad_norm)  # PPO
                common.check_finite(critic_grad_norm, "critic gradient norm", step)
                optimizer.step()
                train_metrics.append({"train/grad_norm": grad_norm, "train/critic_grad_norm": critic_grad_norm})
                # PPO: early stop once the minibatch's token-weighted KL to the behaviour policy (before this step) is large
                if args.target_kl:  # (pooled over the minibatch's micro-batches and the ranks)
                    minibatch_metrics = train_metrics[-1 - len(mb_idx.split(args.micro_batch_size)) : -1]
                    if common.pool_metrics(minibatch_metrics)["kl/old_approx"] > args.target_kl:
                        stop = True
                        break
            if stop:
                break

        # -------------------------------------------------------------------------------------------------------------
        # Log and evaluate
        # -------------------------------------------------------------------------------------------------------------
        row = common.pool_metrics(train_metrics, min_max=("train/ratio",))  # means over tokens or responses
        row.update(
            {
                "rollout/reward_mean": rewards.mean(),
                **reward_functions.metrics(reward_scores),  # reward/NAME of --reward-funcs
                "rollout/gold_accuracy": gold.mean(),
                "rollout/response_length": mask.sum(dim=1).float().mean(),
                **common.lengths_by_outcome(mask.sum(dim=1), gold),
                "rollout/truncated_frac": truncated.float().mean(),
                "train/advantage_mean": raw_advantages.mean(),
                "train/advantage_std": raw_advantages.std(),
                "train/explained_variance": 1
                - raw_advantages.var() / dist.concat_over_ranks(returns[mask]).var().clamp(min=1e-8),
                "train/early_stopped": float(stop),
                "time/rollout": rollout_time,
                "time/step": time.time() - step_start,
                "train/responses": step * args.num_prompts * args.group_size,
            }
        )
        if args.beta > 0:
            kl = torch.where(mask, old_logprobs - ref_logprobs, 0.0)  # (B, T) k1 per token
            row.update({"kl/ref": kl[mask], "rollout/kl_penalty": args.beta * kl.sum(dim=1).mean()})
        if step % args.eval_every == 0 or step == args.total_steps:
            eval_metrics = common.evaluate(policy, tokenizer, task, args.max_new_tokens, args.eval_samples, args.temperature)
            row.update(eval_metrics)
        logger.log(step, row)
        bar.set_postfix(reward=f"{rewards.mean().item():.2f}", eval_accuracy=f"{eval_metrics['eval/accuracy']:.2f}")
        checkpoint.step_done(step)  # saves every --save-every steps; after Ctrl-C or SIGTERM, saves and exits

    # -----------------------------------------------------------------------------------------------------------------
    # Save
    # -----------------------------------------------------------------------------------------------------------------
    dist.save_model(policy, tokenizer, os.path.join(args.output_dir, "model"))  # under torchrun: rank 0, gathered
    logger.close()
    checkpoint.close()
    print(f"eval/accuracy {eval_metrics['eval/accuracy']:.3f} after {args.total_steps} steps; saved to {args.output_dir}")
