"""grpo_engine.py --engine vllm under torchrun, each process's vLLM engine watched (tests/test_vllm_engine.py):

    torchrun --standalone --nproc-per-node 2 tests/vllm_colocated_job.py OUT_FOLDER [grpo_engine.py's flags]

Each process writes OUT_FOLDER/rank{R}.json: the distinct prompts of every batch its engine sampled, and after every
sync of weights the engine's own log-probs of a fixed probe prompt (greedy, vLLM's prompt_logprobs), which show the
weights the engine holds. The verifier is distributed_jobs.text_reward, so that every step has something to learn."""

import json
import os
import runpy
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "tests"))

from distributed_jobs import text_reward  # noqa: E402

import engines  # noqa: E402
import tasks  # noqa: E402
from plumbing import dist  # noqa: E402

record = {"prompts": [], "probes": []}
generate, load_weights = engines.VLLMEngine.generate, engines.VLLMEngine.load_weights


def recording_generate(self, prompt_ids, prompt_mask, *more):
    record["prompts"].append(sorted({tuple(ids[m.bool()].tolist()) for ids, m in zip(prompt_ids, prompt_mask)}))
    return generate(self, prompt_ids, prompt_mask, *more)


def probing_load_weights(self, weights):
    from vllm import SamplingParams

    load_weights(self, weights)
    probe = {"prompt_token_ids": self.tokenizer("12+34=", add_special_tokens=False).input_ids}
    params = SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=0)
    out = self.llm.generate([probe], params, use_tqdm=False)[0]
    record["probes"].append([lp[t].logprob for lp, t in zip(out.prompt_logprobs[1:], probe["prompt_token_ids"][1:])])


if __name__ == "__main__":
    out_folder, sys.argv = sys.argv[1], ["grpo_engine.py", *sys.argv[2:]]
    os.environ["TQDM_DISABLE"] = "1"
    engines.VLLMEngine.generate, engines.VLLMEngine.load_weights = recording_generate, probing_load_weights
    tasks.Task.verify = text_reward  # rewards in 7 levels: the test model answers nothing right, and every step updates
    runpy.run_path(os.path.join(ROOT, "grpo_engine.py"), run_name="__main__")
    with open(os.path.join(out_folder, f"rank{dist.rank()}.json"), "w") as f:
        json.dump(record, f)
