"""llama.cpp's (llama-cpp-python's) greedy token log-probabilities on a GGUF model: the reference
`gpu-engine/tests/serving.rs` compares lockstep's engine with. For each of STEPS greedy steps after
the prompt's token ids: the chosen id, its log-probability and the top 3 (id, log-probability), a
log-softmax of llama.cpp's logits in float64. Prints one JSON line.

    ~/.cache/lockstep-bench/venv-llama/bin/python bench/llamacpp_logprobs.py MODEL.gguf [STEPS]
"""
import json
import math
import sys

import llama_cpp

path = sys.argv[1]
steps = int(sys.argv[2]) if len(sys.argv) > 2 else 6
PROMPT = [504, 3575, 282, 4649, 314]  # "The capital of France is"
llm = llama_cpp.Llama(model_path=path, n_ctx=256, n_threads=2, logits_all=True, verbose=False)
llm.eval(PROMPT)
out = []
for _ in range(steps):
    logits = [float(x) for x in llm.scores[llm.n_tokens - 1]]
    m = max(logits)
    lz = m + math.log(sum(math.exp(x - m) for x in logits))
    order = sorted(range(len(logits)), key=lambda i: (-logits[i], i))
    tid = order[0]
    out.append({"id": tid, "logprob": round(logits[tid] - lz, 5),
                "top": [[i, round(logits[i] - lz, 5)] for i in order[:3]]})
    llm.eval([tid])
print(json.dumps({"prompt": PROMPT, "steps": out, "llama_cpp_python": llama_cpp.__version__}))
