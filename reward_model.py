"""Reward model: fit a Bradley-Terry model of preferences, to be optimised against (Ouyang et al. 2022, InstructGPT,
§3.5; Stiennon et al. 2020, §3.4).

The probability that y_w is preferred to y_l for the prompt x is modelled as sigma(R(x, y_w) - R(x, y_l)) (Bradley and
Terry 1952), and R is fitted by minimising -log sigma(R_w - R_l) over the pairs. R is the warm-up policy's body with a
new linear head on the last layer's hidden state at the response's last token (AutoModelForSequenceClassification
with one output). It is then held fixed while a policy is optimised against it, the classic pipeline: supervised
warm-up (sft.py), reward model (this file), PPO (ppo.py; grpo.py and its siblings take it too):

    python reward_model.py
    python ppo.py --reward-model runs/reward_model__1/model --beta 0.5   # a KL penalty strong enough for a proxy

The policy then sees only R; the verifier stays in the logs as the gold measure (rollout/gold_accuracy, eval/accuracy),
so that over-optimisation of the learned proxy (Gao et al. 2022) shows as a rising reward with a flat or falling
accuracy.

What the pairs do not identify: only differences R_w - R_l enter the loss, so R(x, y) + c(x) fits them exactly as well,
for any constant c(x) per prompt. The reward's zero point is free, and a score means something only next to another
score for the same prompt. We pin it softly with a centring term, center_coef * mean((R_w + R_l)^2) (Eisenstein et al.
2023), which pulls each pair's two scores to sum to 0 and leaves their difference to the data. GRPO and RLOO compare
responses to the same prompt and never see c(x); PPO does (its critic must learn it, and the reward's scale sets the
weight of the KL penalty), so a centred reward is the one to give it.

Built-in data: the verifier-labelled pairs of dpo.py (preference_pairs.py: the warm-up policy's most frequent correct
answer against its most frequent wrong one, per training problem), built once and cached for both scripts.
`--dataset` takes any local or hub dataset with prompt / chosen / rejected columns instead. A held-out part of the
pairs is split off by problem: on the built-in tasks a problem and its commuted twin ("07+45=", "45+07=") stay on one
side; on a user's data set, rows with the same prompt do.

Departures from InstructGPT:
1. Preferences come from the task's verifier (correct beats wrong), one pair per problem, not human rankings of K
   responses.
2. The centring term above (InstructGPT instead shifts the finished model by a constant, so that the warm-up's answers
   score 0 on average).
"""

import os
import time
from dataclasses import dataclass

import torch
import torch.nn.functional as F
import tyro
from tqdm import tqdm

import common
import preference_pairs
import tasks
from plumbing import checks, dist, lora, models, run_state


@dataclass
class Args:
    exp_name: str = os.path.basename(__file__)[: -len(".py")]
    """name of this experiment (the script's name)"""
    seed: int = 1
    """seed of the new head's initialisation and of the batch order"""
    device: str = "auto"
    """auto (CUDA when available), cpu or cuda"""
    model_name_or_path: str = "builtin"
    """'builtin' (the tiny model after its cached warm-up, see sft.py), a local folder, or a hub id"""
    cache_dir: str = ""
    """where the built-in model is cached (default: $TINY_RLHF_CACHE or ~/.cache/tiny-rlhf)"""
    task: str = "addition"
    """'addition' or 'scratchpad' (offline, for the built-in model), 'sums' (offline, for a chat model) or 'gsm8k' (hub)"""
    chat_template: str = "auto"
    """auto: prompts rendered with the tokenizer's chat template when it has one (as the RL scripts do: the reward model
    must read the prompts they will feed it); none: plain prompts; on: like auto, but a template is required"""
    instruction: str = ""
    """the system message a chat model gets with each prompt: the answer format (default: the task's own, e.g. for
    --dataset prompts scored like gsm8k, "Solve the problem step by step. End your reply with ... a plain number.")"""
    output_dir: str = ""
    """where metrics.jsonl and the reward model go (default: runs/EXP_NAME__SEED)"""
    eval_every: int = 20
    """evaluate held-out pairwise accuracy every this many steps (and before the first and after the last)"""
    save_every: int = 50
    """save a checkpoint (trained weights, optimizer, random states, step) every this many steps, and when interrupted"""
    resume: bool = False
    """continue the run in --output-dir from its checkpoint, appending to its metrics.jsonl"""
    overwrite: bool = False
    """start afresh in an --output-dir that holds another run, replacing its metrics, samples and checkpoint"""
    gradient_checkpointing: bool = False
    """recompute each layer's activations in the backward pass instead of storing them: less memory, slower steps"""

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
    total_steps: int = 600
    """optimizer steps (about 13 epochs over the built-in addition pairs)"""
    batch_size: int = 64
    """pairs per optimizer step"""
    micro_batch_size: int = 0
    """pairs per forward/backward pass, for memory (0: the whole batch); does not change the gradient"""
    learning_rate: float = 0.0
    """AdamW learning rate (0: 3e-4 for the built-in model, whose new head is fitted from scratch; 1e-5 for a pretrained
    one)"""
    max_grad_norm: float = 1.0
    """gradient clipping threshold"""
    center_coef: float = 0.01
    """weight of the centring term mean((R_w + R_l)^2) that pins the reward's free zero point (0: off)"""
    num_eval: int = 400
    """pairs held out for evaluation, split off by problem"""
    dataset: str = ""
    """a local folder (datasets.save_to_disk or .json/.jsonl) or hub id with prompt, chosen, rejected columns
    (default: the pairs dpo.py builds from the warm-up policy's own answers)"""
    num_pair_prompts: int = 4000
    """built-in pairs: training problems to answer (as in dpo.py, whose cached pairs are reused)"""
    group_size: int = 8
    """built-in pairs: answers sampled per problem, at temperature 1"""
    max_new_tokens: int = 0
    """generation budget of the built-in pairs (0: the task's own, 8 for addition, 64 for scratchpad)"""

    def __post_init__(self):
        self.output_dir = self.output_dir or f"runs/{self.exp_name}__{self.seed}"
        self.micro_batch_size = self.micro_batch_size or self.batch_size
        self.learning_rate = self.learning_rate or (3e-4 if self.model_name_or_path == "builtin" else 1e-5)


def check_args(args: Args) -> None:
    """Fail fast with the flag's name, before any expensive work."""
    tasks.check_task_flag(args)
    checks.model_task_and_device(args)
    checks.distributed_flags(args, "batch_size")  # under torchrun each process takes its share of every batch
    checks.data_flags(args)
    for flag in ("learning_rate", "max_grad_norm"):
        checks.flag(args, flag, "must be positive", lambda v: v > 0)
    checks.flag(args, "center_coef", "must be 0 (off) or positive", lambda v: v >= 0)
    checks.flag(args, "max_new_tokens", "must be 0 (the task's) or positive", lambda v: v >= 0)
    for flag in ("total_steps", "batch_size", "num_eval", "num_pair_prompts", "eval_every"):
        checks.flag(args, flag, "must be at least 1", lambda v: v >= 1)
    checks.flag(args, "group_size", "needs at least 2 answers per problem to make a pair", lambda v: v >= 2)
    checks.flag(args, "micro_batch_size", "must be 0 (the whole batch) or positive", lambda v: v >= 0)
    if args.batch_size % args.micro_batch_size:
        raise SystemExit(f"--batch-size {args.batch_size} must split into --micro-batch-size {args.micro_batch_size}")
    checks.resume_flags(args)
    checks.output_folders(args)


# ---------------------------------------------------------------------------------------------------------------------
# Algorithm: loss (a pure function of tensors)
# ---------------------------------------------------------------------------------------------------------------------


def compute_loss(chosen_rewards, rejected_rewards, args):
    """Bradley-Terry negative log-likelihood of the pairs (InstructGPT eq. 1), -log sigmoid(R_w - R_l) averaged over
    pairs, plus center_coef * mean((R_w + R_l)^2), the centring term that pins the zero point the pairs leave free.
    chosen_rewards, rejected_rewards: (N,) scores R(x, y_w), R(x, y_l). Per pair, the first term's gradient is
    -sigmoid(-(R_w - R_l)) = -(1 - P(y_w preferred)) with respect to R_w and the opposite with respect to R_l: pairs
    the model already ranks right with a wide margin stop pulling. A constant added to both scores changes the first
    term not at all (and the second, by design)."""
    margins = chosen_rewards - rejected_rewards  # (N,) R_w - R_l
    losses = -F.logsigmoid(margins)  # (N,) -log P(y_w preferred to y_l)
    centring = (chosen_rewards + rejected_rewards) ** 2  # (N,) zero when the pair's scores are symmetric about 0
    loss = losses.mean() + args.center_coef * centring.mean()
    with torch.no_grad():  # one sample per pair, pooled over micro-batches by common.pool_metrics
        metrics = {
            "loss/rm": losses,
            "loss/centring": args.center_coef * centring,
            "train/pairwise_accuracy": (margins > 0).float(),  # strict: a tie counts as wrong
            "train/margin": margins,
        }
    return loss, metrics


# ---------------------------------------------------------------------------------------------------------------------
# Data: preference pairs, split by problem
# ---------------------------------------------------------------------------------------------------------------------


def split_pairs(pairs, num_eval_pairs: int, by_operands: bool):
    """(train, held_out) pairs, with every problem on one side only: keyed by the unordered pair of operands on the
    built-in tasks (a problem and its commuted twin have one answer), by the prompt otherwise. The split is fixed
    (seed 0), the same for every --seed."""
    key = tasks.addition_operands if by_operands else (lambda row: row["prompt"])
    return tasks.split_by_key(pairs, num_eval_pairs, key, seed=0)


def pair_rewards(model, data, idx):
    """R(x, y_w) and R(x, y_l), (b,) each, of the pairs `idx` of preference_pairs.tokenize_pairs' dict."""
    prompt_ids, prompt_mask = data["prompt_ids"][idx], data["prompt_mask"][idx]
    rewards = []
    for key in ("chosen", "rejected"):
        input_ids = torch.cat([prompt_ids, data[f"{key}_ids"][idx]], dim=1)
        attention_mask = torch.cat([prompt_mask, data[f"{key}_mask"][idx].long()], dim=1)
        rewards.append(common.sequence_rewards(model, input_ids, attention_mask))
    return rewards


@torch.no_grad()
def evaluate_pairs(model, data, chunk_size: int) -> dict:
    """Held-out pairwise accuracy (R_w > R_l, strictly), mean margin and mean score of each side."""
    chunks = torch.arange(len(data["prompt_ids"]), device=data["prompt_ids"].device).split(chunk_size)
    chosen, rejected = (torch.cat(x) for x in zip(*[pair_rewards(model, data, idx) for idx in chunks]))
    return {
        "eval/pairwise_accuracy": (chosen > rejected).float().mean().item(),
        "eval/margin": (chosen - rejected).mean().item(),
        "eval/reward_chosen": chosen.mean().item(),
        "eval/reward_rejected": rejected.mean().item(),
    }


# ---------------------------------------------------------------------------------------------------------------------
# Setup
# ---------------------------------------------------------------------------------------------------------------------

if __name__ == "__main__":
    from transformers import AutoModelForSequenceClassification

    args = tyro.cli(Args)
    check_args(args)
    device = dist.init_device(args.device)  # auto: CUDA when available; under torchrun, this process's own device
    common.seed_everything(args.seed + dist.rank())  # under torchrun each process draws its own numbers
    args.max_new_tokens = args.max_new_tokens or tasks.verifier(args.task)[1]  # the task's budget unless --max-new-tokens
    # a user's pairs are read before any model is loaded (and the task's data is not needed), else the task's problems
    user_pairs = preference_pairs.load_pairs(args.dataset) if args.dataset else None
    task = None if args.dataset else tasks.make_task(args.task)
    # the tokenizer first, alone: the pairs are rendered, split and checked before any weights load
    tokenizer = models.load_tokenizer(args.model_name_or_path, args.cache_dir, args.task)
    if args.dataset:  # a user's pairs, their prompts rendered as the policy reads them (--chat-template)
        pairs, skipped, pairs_time = preference_pairs.render_prompts(user_pairs, tokenizer, args).train, 0, 0.0
    else:  # dpo.py's pairs: from the cache, or built once by the warm-up policy (loaded only then) and cached for both
        task = tasks.apply_chat_template(task, tokenizer, args.chat_template, args.instruction)  # as the policy reads it
        dtype = lora.base_dtype(args, device)  # the policy's own, as dpo.py builds them: a LoRA base may be bf16 (on a GPU)
        load_policy = lambda: models.load_model_and_tokenizer(
            args.model_name_or_path, args.cache_dir, device, args.task, dtype
        )
        pairs, skipped, pairs_time = preference_pairs.cached_verifier_pairs(args, task, load_policy, device)
    # the built-in tasks' plain prompts are split by operands (a problem and its twin together), anything else by prompt
    by_operands = task is not None and args.task in tasks.BUILTIN_TASKS and not task.chat
    train_pairs, eval_pairs = split_pairs(pairs, args.num_eval, by_operands)
    if len(train_pairs) < args.batch_size or len(eval_pairs) == 0:
        raise SystemExit(
            f"{len(pairs)} preference pairs ({skipped} prompts skipped): {len(eval_pairs)} held out by problem leave "
            f"{len(train_pairs)} to train on, fewer than --batch-size {args.batch_size} (or none held out)"
        )
    print(f"{len(pairs)} preference pairs: {len(train_pairs)} to train on, {len(eval_pairs)} held out")
    # the warm-up policy's body with a new one-output head; models stay in eval mode throughout (no dropout)
    model = models.load_model(
        args.model_name_or_path,
        args.cache_dir,
        device,
        args.task,
        lora.base_dtype(args, device),
        AutoModelForSequenceClassification,
        num_labels=1,
    )
    model.config.pad_token_id = tokenizer.pad_token_id  # so that the saved model also works with the library's pooling
    if args.gradient_checkpointing:
        models.enable_gradient_checkpointing(model)
    if args.lora_rank:  # train a low-rank adapter on the frozen body instead of every weight; the new head is trained whole
        model = lora.add_adapter(model, args, trained_modules=("score",))
    train_data = preference_pairs.tokenize_pairs(tokenizer, train_pairs[:], device)
    eval_data = preference_pairs.tokenize_pairs(tokenizer, eval_pairs[:], device)
    (model,) = dist.prepare_models(args, model)  # under torchrun: rank 0's weights (its new head) on every rank
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.learning_rate, weight_decay=0.0)
    generator = torch.Generator(device="cpu").manual_seed(args.seed)
    checkpoint = run_state.Checkpoint(args, optimizer, generator)  # --resume: restores the run
    # time/elapsed: training, not the pairs; under torchrun, pools every row over the processes
    logger = run_state.MetricsLogger(args.output_dir, checkpoint.resumed_step, common.pool_metrics)
    if args.track:  # every logged row to trackio too, with the flags as the run's config
        logger.track(vars(args))
    eval_metrics = logger.last_eval or evaluate_pairs(model, eval_data, args.micro_batch_size)
    data_metrics = {"data/pairs": len(train_pairs), "data/eval_pairs": len(eval_pairs), "time/pairs": pairs_time}
    logger.log(0, {**eval_metrics, **data_metrics})
    order = checkpoint.extra.get("order", torch.empty(0, dtype=torch.long))  # the pairs left in this epoch

    bar = tqdm(range(checkpoint.step + 1, args.total_steps + 1), args.exp_name, disable=not dist.is_main())
    for step in bar:
        step_start = time.time()
        if len(order) < args.batch_size:  # a new epoch over the pairs, in a new order
            order = torch.randperm(len(train_pairs), generator=generator)
        mb_idx, order = dist.shard(order[: args.batch_size]).to(device), order[args.batch_size :]  # torchrun: a share

        # -------------------------------------------------------------------------------------------------------------
        # Update: one optimizer step per batch of pairs
        # -------------------------------------------------------------------------------------------------------------
        optimizer.zero_grad()
        train_metrics = []
        for idx in mb_idx.split(args.micro_batch_size):
            chosen_rewards, rejected_rewards = pair_rewards(model, train_data, idx)  # (b,) each
            loss, metrics = compute_loss(chosen_rewards, rejected_rewards, args)
            loss = loss * len(idx) / len(mb_idx)  # micro-batches add up to the batch's mean
            common.check_finite(loss, "loss", step)
            loss.backward()
            train_metrics.append(metrics)
        dist.average_gradients(optimizer)  # under torchrun: every gradient becomes its mean over the processes
        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), args.max_grad_norm)
        common.check_finite(grad_norm, "gradient norm", step)
        optimizer.step()

        # -------------------------------------------------------------------------------------------------------------
        # Log and evaluate
        # -------------------------------------------------------------------------------------------------------------
        row = common.pool_metrics(train_metrics)
        row.update({"train/grad_norm": grad_norm, "time/step": time.time() - step_start})
        if step % args.eval_every == 0 or step == args.total_steps:
            eval_metrics = evaluate_pairs(model, eval_data, args.micro_batch_size)
            row.update(eval_metrics)
        logger.log(step, row)
        bar.set_postfix(loss=f"{row['loss/rm'].item():.3f}", eval_accuracy=f"{eval_metrics['eval/pairwise_accuracy']:.2f}")
        # saves every --save-every steps, with the pairs left in this epoch (--resume goes on with them); after Ctrl-C
        # or SIGTERM, saves and exits
        checkpoint.step_done(step, extra={"order": order})

    # -----------------------------------------------------------------------------------------------------------------
    # Save
    # -----------------------------------------------------------------------------------------------------------------
    dist.save_model(model, tokenizer, os.path.join(args.output_dir, "model"))  # under torchrun: rank 0
    logger.close()
    checkpoint.close()
    print(
        f"eval/pairwise_accuracy {eval_metrics['eval/pairwise_accuracy']:.3f} after {args.total_steps} steps; "
        f"saved to {args.output_dir}/model (use it with --reward-model)"
    )
