"""DPO: direct preference optimisation on (prompt, chosen, rejected) pairs (Rafailov et al. 2023, §4).

The KL-regularised reward maximisation problem has the closed-form optimum pi*(y) proportional to
pi_ref(y) exp(R(y) / beta), so the reward is beta log(pi* / pi_ref) up to a per-prompt constant that cancels in a
difference. Substituting it into the Bradley-Terry likelihood of a preference gives a classification loss on pairs,
-log sigmoid(beta * [(log pi(y_w) - log pi_ref(y_w)) - (log pi(y_l) - log pi_ref(y_l))]), with no sampling, no reward
model and no critic during training. Sequence log-probs are sums over the completion tokens.

    python dpo.py

Built-in data: the warm-up policy answers each of `num_pair_prompts` training problems `group_size` times; a correct
and a wrong answer to the same problem make a pair (problems without both are skipped and counted). The pairs are
built once and cached, and the policy is evaluated on the task's held-out problems. `--dataset` takes any local or hub
data set with prompt / chosen / rejected columns instead: `--num-eval` of its pairs are held out by prompt, and the
implicit reward is evaluated on them (its accuracy and margin, as preference libraries report it); with an `answer`
column, the held-out prompts are also answered greedily and scored by the `--task` verifier. Nothing is then read from
the hub.

Departures from the paper:
1. Preferences come from the task's verifier (correct beats wrong), not from human labels, and the reference model
   is the warm-up policy that also produced the pairs (on-distribution, as the paper recommends).
2. Each completion ends with EOS, which counts as a token of the response (it is the policy's decision to stop).
3. The reference log-probs are computed once, before training; dropout stays off (eval mode), so they are exact.
4. beta = 1.0, not the paper's 0.1: with a verifier's certain preferences, at 0.1 the policy drifts from pi_ref and
   loses held-out accuracy after 20-30 steps (the sweep: docs/results.md#the-preference-family).
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
    """seed of prompt sampling, generation and minibatch order"""
    device: str = "auto"
    """auto (CUDA when available), cpu or cuda"""
    model_name_or_path: str = "builtin"
    """'builtin' (the tiny model after its cached warm-up, see sft.py), a local folder, or a hub id"""
    cache_dir: str = ""
    """where the built-in model is cached (default: $TINY_RLHF_CACHE or ~/.cache/tiny-rlhf)"""
    task: str = "addition"
    """'addition' or 'scratchpad' (offline, for the built-in model), 'sums' (offline, for a chat model) or 'gsm8k' (hub)"""
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
    total_steps: int = 80
    """optimizer steps (about one and a half epochs over the built-in pairs; held-out accuracy against steps, and by
    warm-up: docs/results.md#the-preference-family)"""
    batch_size: int = 64
    """pairs per optimizer step"""
    micro_batch_size: int = 0
    """pairs per forward/backward pass, for memory (0: the whole batch); does not change the gradient"""
    learning_rate: float = 1e-5
    """AdamW learning rate (with beta = 1.0; at beta = 0.1 this rate drifts away from the reference: see departure 4)"""
    max_grad_norm: float = 1.0
    """gradient clipping threshold"""
    beta: float = 1.0
    """the KL coefficient of the implicit reward beta * log(pi / pi_ref) (ten times the paper's 0.1: see departure 4)"""
    dataset: str = ""
    """a local folder (datasets.save_to_disk or .json/.jsonl) or hub id with prompt, chosen, rejected columns, and
    optionally answer (default: pairs built from the warm-up policy's own answers)"""
    num_eval: int = 500
    """with --dataset: pairs held out for evaluation (at most half; split by prompt, never trained on)"""
    num_pair_prompts: int = 4000
    """built-in pairs: training problems to answer"""
    group_size: int = 8
    """built-in pairs: answers sampled per problem, at temperature 1"""
    max_new_tokens: int = 0
    """generation budget of the built-in pairs and of the evaluation (0: the task's own, 8 for addition, 64 for scratchpad)"""

    def __post_init__(self):
        self.output_dir = self.output_dir or f"runs/{self.exp_name}__{self.seed}"
        self.micro_batch_size = self.micro_batch_size or self.batch_size


def check_args(args: Args) -> None:
    """Fail fast with the flag's name, before any expensive work."""
    tasks.check_task_flag(args)
    checks.model_task_and_device(args)
    checks.distributed_flags(args, "batch_size")  # under torchrun each process takes its share of every batch
    for flag in ("beta", "learning_rate", "max_grad_norm"):
        checks.flag(args, flag, "must be positive", lambda v: v > 0)
    checks.flag(args, "max_new_tokens", "must be 0 (the task's) or positive", lambda v: v >= 0)
    for flag in ("total_steps", "batch_size", "num_pair_prompts", "eval_every", "num_eval"):
        checks.flag(args, flag, "must be at least 1", lambda v: v >= 1)
    checks.flag(args, "group_size", "needs at least 2 answers per problem to make a pair", lambda v: v >= 2)
    checks.flag(args, "micro_batch_size", "must be 0 (the whole batch) or positive", lambda v: v >= 0)
    if args.batch_size % args.micro_batch_size:
        raise SystemExit(f"--batch-size {args.batch_size} must split into --micro-batch-size {args.micro_batch_size}")
    checks.data_flags(args)
    checks.resume_flags(args)
    checks.output_folders(args)


# ---------------------------------------------------------------------------------------------------------------------
# Algorithm: loss (a pure function of tensors)
# ---------------------------------------------------------------------------------------------------------------------


def compute_loss(chosen_logps, rejected_logps, ref_chosen_logps, ref_rejected_logps, args):
    """DPO loss (Rafailov et al. 2023, eq. 7): -log sigmoid(beta * Delta), averaged over pairs, with
    Delta = (log pi(y_w) - log pi_ref(y_w)) - (log pi(y_l) - log pi_ref(y_l)). All inputs: (N,) sequence log-probs
    (sums over completion tokens); the reference ones are constants. Its gradient per pair is
    -beta * sigmoid(-beta * Delta) * (grad log pi(y_w) - grad log pi(y_l)) (§5.1)."""
    chosen_rewards = args.beta * (chosen_logps - ref_chosen_logps)  # (N,) implicit rewards beta * log(pi / pi_ref)
    rejected_rewards = args.beta * (rejected_logps - ref_rejected_logps)
    margins = chosen_rewards - rejected_rewards  # beta * Delta
    losses = -F.logsigmoid(margins)  # (N,)
    with torch.no_grad():  # one sample per pair, pooled over micro-batches by common.pool_metrics
        metrics = {
            "loss/dpo": losses,
            "rewards/chosen": chosen_rewards,
            "rewards/rejected": rejected_rewards,
            "rewards/margins": margins,
            "rewards/accuracies": (chosen_rewards > rejected_rewards).float(),  # strict: ties count as wrong
        }
    loss = losses.mean()
    return loss, metrics


def sequence_logps(model, prompt_ids, prompt_mask, completion_ids, mask):
    """log pi(y | x) = sum over the completion's valid tokens of log pi(y_t | x, y_<t) (prompt and padding
    excluded). prompt_ids, prompt_mask: (N, P) left-padded; completion_ids, mask: (N, T) right-padded. Returns (N,)."""
    input_ids = torch.cat([prompt_ids, completion_ids], dim=1)
    attention_mask = torch.cat([prompt_mask, mask.long()], dim=1)
    logprobs, _ = common.completion_logprobs(model, input_ids, attention_mask, completion_ids.shape[1], 1.0)
    return torch.where(mask, logprobs, 0.0).sum(dim=1)


@torch.no_grad()
def evaluate_pairs(model, data, ref_chosen_logps, ref_rejected_logps, args) -> dict:
    """The implicit reward beta log(pi / pi_ref) on held-out pairs (never trained on): the fraction it ranks right, its
    mean margin, the mean rewards of each side and the DPO loss, as eval/... metrics."""
    chunks = torch.arange(len(ref_chosen_logps), device=ref_chosen_logps.device).split(args.micro_batch_size)
    rows = [compute_loss(*pair_logps(model, data, i), ref_chosen_logps[i], ref_rejected_logps[i], args)[1] for i in chunks]
    return {f"eval/{name.replace('/', '_')}": value.item() for name, value in common.pool_metrics(rows).items()}


@torch.no_grad()
def reference_logps(model, data, chunk_size: int):
    """Sequence log-probs of every chosen and rejected completion of `data` under the model, before any update."""
    chunks = torch.arange(len(data["prompt_ids"]), device=data["prompt_ids"].device).split(chunk_size)
    return (torch.cat(x) for x in zip(*[pair_logps(model, data, idx) for idx in chunks]))


def pair_logps(model, data, idx):
    """Sequence log-probs (b,) of the chosen and of the rejected completions of the pairs `idx` (data: tokenize_pairs)."""
    prompt = (data["prompt_ids"][idx], data["prompt_mask"][idx])
    chosen_logps = sequence_logps(model, *prompt, data["chosen_ids"][idx], data["chosen_mask"][idx])
    rejected_logps = sequence_logps(model, *prompt, data["rejected_ids"][idx], data["rejected_mask"][idx])
    return chosen_logps, rejected_logps


# ---------------------------------------------------------------------------------------------------------------------
# Setup
# ---------------------------------------------------------------------------------------------------------------------

if __name__ == "__main__":
    args = tyro.cli(Args)
    check_args(args)
    device = dist.init_device(args.device)  # auto: CUDA when available; under torchrun, this process's own device
    common.seed_everything(args.seed + dist.rank())  # under torchrun each process draws its own numbers
    task, eval_pairs = None, None  # what the policy is evaluated on: the task's problems, or held-out pairs (--dataset)
    user_pairs = preference_pairs.load_pairs(args.dataset) if args.dataset else None  # read before any model is loaded
    args.max_new_tokens = args.max_new_tokens or tasks.verifier(args.task)[1]  # the task's budget unless --max-new-tokens
    # the tokenizer first, alone: the prompts are rendered (and a bad one refused) before any weights load
    tokenizer = models.load_tokenizer(args.model_name_or_path, args.cache_dir, args.task)
    if args.dataset:  # a user's pairs, their prompts rendered as the model reads them (--chat-template), some held out
        rendered = preference_pairs.render_prompts(user_pairs, tokenizer, args)
        user_pairs, eval_pairs = preference_pairs.split_held_out(rendered.train, args.num_eval)
        if "answer" in user_pairs.column_names:  # held-out prompts to answer, scored by the task's verifier
            answers = lambda ds: ds.select_columns(["prompt", "answer"]).map(lambda r: {"answer": str(r["answer"]).strip()})
            task = tasks.Task(
                args.task, answers(user_pairs), answers(eval_pairs), *tasks.verifier(args.task), chat=rendered.chat
            )
        pairs, skipped, pairs_time = user_pairs, 0, 0.0
    else:  # the task's problems as the model reads them, and pairs built on them once by the warm-up policy (loaded only
        # then), cached and shared with reward_model.py (pairs_time is 0 from the cache)
        task = tasks.apply_chat_template(tasks.make_task(args.task), tokenizer, args.chat_template, args.instruction)
        dtype = lora.base_dtype(args, device)  # the policy's own: a LoRA base may be bf16 (on a GPU)
        load_policy = lambda: models.load_model_and_tokenizer(
            args.model_name_or_path, args.cache_dir, device, args.task, dtype
        )
        pairs, skipped, pairs_time = preference_pairs.cached_verifier_pairs(args, task, load_policy, device)
    if len(pairs) < args.batch_size:
        raise SystemExit(f"only {len(pairs)} preference pairs ({skipped} prompts skipped): fewer than --batch-size")
    generated = 0 if args.dataset else args.num_pair_prompts * args.group_size  # responses sampled to build the pairs
    print(f"{len(pairs)} preference pairs ({skipped} prompts had no correct-and-wrong pair)")
    policy = models.load_model(
        args.model_name_or_path, args.cache_dir, device, args.task, lora.base_dtype(args, device)
    )  # float32, or with --lora-rank the frozen weights in --lora-base-dtype
    if args.gradient_checkpointing:
        models.enable_gradient_checkpointing(policy)
    if args.lora_rank:  # train a low-rank adapter on the frozen weights instead of every weight
        policy = lora.add_adapter(policy, args)
    # models stay in eval mode throughout: no dropout, so that log pi_ref below is exactly the reference's
    data = preference_pairs.tokenize_pairs(tokenizer, pairs[:], device)
    # the reference is the starting policy: its log-probs, once, before any update
    ref_chosen_logps, ref_rejected_logps = reference_logps(policy, data, args.micro_batch_size)
    if eval_pairs is not None:
        eval_data = preference_pairs.tokenize_pairs(tokenizer, eval_pairs[:], device)
        ref_eval_logps = tuple(reference_logps(policy, eval_data, args.micro_batch_size))

    def evaluate() -> dict:  # the held-out pairs (--dataset) and, where there are answers, greedy accuracy
        metrics = evaluate_pairs(policy, eval_data, *ref_eval_logps, args) if eval_pairs is not None else {}
        return {**metrics, **(common.evaluate(policy, tokenizer, task, args.max_new_tokens) if task else {})}

    (policy,) = dist.prepare_models(args, policy)  # torchrun: rank 0's weights everywhere, or FSDP2 (--fsdp)
    optimizer = torch.optim.AdamW(policy.parameters(), lr=args.learning_rate, weight_decay=0.0)
    generator = torch.Generator(device="cpu").manual_seed(args.seed)
    checkpoint = run_state.Checkpoint(args, optimizer, generator)  # --resume: restores the run
    # with --resume: appends after that step; under torchrun, pools every row over the processes
    logger = run_state.MetricsLogger(args.output_dir, checkpoint.resumed_step, common.pool_metrics)
    if args.track:  # every logged row to trackio too, with the flags as the run's config
        logger.track(vars(args))
    eval_metrics = logger.last_eval or evaluate()
    pairs_metrics = {
        "data/pairs": len(pairs),
        "data/skipped_prompts": skipped,
        "time/pairs": pairs_time,
        "train/responses": generated,
    }
    logger.log(0, {**eval_metrics, **pairs_metrics})
    order = checkpoint.extra.get("order", torch.empty(0, dtype=torch.long))  # the pairs left in this epoch

    bar = tqdm(range(checkpoint.step + 1, args.total_steps + 1), args.exp_name, disable=not dist.is_main())
    for step in bar:
        step_start = time.time()
        if len(order) < args.batch_size:  # a new epoch over the pairs, in a new order
            order = torch.randperm(len(pairs), generator=generator)
        mb_idx, order = dist.shard(order[: args.batch_size]).to(device), order[args.batch_size :]  # torchrun: a share

        # -------------------------------------------------------------------------------------------------------------
        # Update: one optimizer step per batch of pairs
        # -------------------------------------------------------------------------------------------------------------
        optimizer.zero_grad()
        train_metrics = []
        for idx in mb_idx.split(args.micro_batch_size):
            chosen_logps, rejected_logps = pair_logps(policy, data, idx)  # (b,) each
            loss, metrics = compute_loss(chosen_logps, rejected_logps, ref_chosen_logps[idx], ref_rejected_logps[idx], args)
            loss = loss * len(idx) / len(mb_idx)  # micro-batches add up to the batch's mean
            common.check_finite(loss, "loss", step)
            loss.backward()
            train_metrics.append(metrics)
        dist.average_gradients(optimizer)  # under torchrun: every gradient becomes its mean over the processes
        grad_norm = torch.nn.utils.clip_grad_norm_(policy.parameters(), args.max_grad_norm)
        common.check_finite(grad_norm, "gradient norm", step)
        optimizer.step()

        # -------------------------------------------------------------------------------------------------------------
        # Log and evaluate
        # -------------------------------------------------------------------------------------------------------------
        row = common.pool_metrics(train_metrics)
        row.update({"train/grad_norm": grad_norm, "time/step": time.time() - step_start, "train/responses": generated})
        if step % args.eval_every == 0 or step == args.total_steps:
            eval_metrics = evaluate()
            row.update(eval_metrics)
        logger.log(step, row)
        shown = {k: f"{eval_metrics[k]:.2f}" for k in ("eval/accuracy", "eval/rewards_accuracies") if k in eval_metrics}
        bar.set_postfix(loss=f"{row['loss/dpo'].item():.3f}", **{k.split("/")[1]: v for k, v in shown.items()})
        # saves every --save-every steps, with the pairs left in this epoch (--resume goes on with them); after Ctrl-C
        # or SIGTERM, saves and exits
        checkpoint.step_done(step, extra={"order": order})

    # -----------------------------------------------------------------------------------------------------------------
    # Save
    # -----------------------------------------------------------------------------------------------------------------
    dist.save_model(policy, tokenizer, os.path.join(args.output_dir, "model"))  # under torchrun: rank 0, gathered
    logger.close()
    checkpoint.close()
    shown = ", ".join(f"{k} {eval_metrics[k]:.3f}" for k in ("eval/accuracy", "eval/rewards_accuracies") if k in eval_metrics)
    print(f"{shown} after {args.total_steps} steps; saved to {args.output_dir}")
