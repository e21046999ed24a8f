"""Write two-digit sums as a conversational data set, the way the hub's chat data sets are written: one JSON object a
line, its `prompt` a list of {"role", "content"} messages (a system message that asks for a format, then the question),
and the reference answer in a column of its own, `solution`.

    python examples/make_chat_sums.py chat_sums.jsonl
"""

import json
import sys

SYSTEM = "Answer with one line of the form: a + b = sum"

if __name__ == "__main__":
    path = sys.argv[1] if len(sys.argv) > 1 else "chat_sums.jsonl"
    with open(path, "w") as f:
        for a in range(10, 100):
            for b in range(10, 100):
                prompt = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": f"What is {a} + {b}?"}]
                f.write(json.dumps({"prompt": prompt, "solution": str(a + b)}) + "\n")
    print(f"wrote 8100 conversations to {path}")
