"""Server metrics in Prometheus' text format (GET /metrics): counters, gauges and latency histograms.

The serving loop's thread writes them and HTTP handlers read them, under one lock. Names:

    nanoinfer_requests_total{outcome}        finished, aborted (client left), failed, rejected (4xx/429/503)
    nanoinfer_prompt_tokens_total            prompt tokens of admitted requests
    nanoinfer_generation_tokens_total        tokens produced (sampled and tool-forced)
    nanoinfer_preemptions_total              requests preempted for memory (recomputed later)
    nanoinfer_queue_depth                    requests waiting for admission
    nanoinfer_batch_rows                     rows decoding together in the last step
    nanoinfer_kv_cache_bytes                 KV memory held now; nanoinfer_kv_cache_budget_bytes its bound (0: none)
    nanoinfer_prompt_tokens_prefilled        of the requests still in prefill, prompt tokens prefilled so far;
    nanoinfer_prompt_tokens_pending          and those still to prefill (a long prompt's progress)
    nanoinfer_time_to_first_token_seconds    histogram, arrival to first token
    nanoinfer_request_seconds                histogram, arrival to last token
    nanoinfer_step_seconds                   histogram, one engine step

and beside them the same quantities under vLLM's names, each with a `model_name` label, so dashboards, routers
and the Gateway API Inference Extension built for vLLM read them: vllm:num_requests_running,
vllm:num_requests_waiting, vllm:kv_cache_usage_perc (a fraction, 0 without a KV bound), vllm:prompt_tokens_total,
vllm:generation_tokens_total, vllm:num_preemptions_total, vllm:prefix_cache_queries_total and
vllm:prefix_cache_hits_total (prompt tokens looked up and found), vllm:time_to_first_token_seconds,
vllm:inter_token_latency_seconds and vllm:e2e_request_latency_seconds; and vllm:cache_config_info (block_size,
num_gpu_blocks: the KV budget's blocks, 0 without one; enable_prefix_caching) once load_routes.py sets it.
"""

from __future__ import annotations

import bisect
import threading

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


class Histogram:
    def __init__(self, buckets: tuple[float, ...] = LATENCY_BUCKETS):
        self.buckets = buckets
        self.counts = [0] * (len(buckets) + 1)      # the last one is +Inf
        self.total = 0.0

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.buckets, value)] += 1
        self.total += value

    def lines(self, name: str, labels: str = "") -> list[str]:
        """`labels`: 'key="value",' pairs put before each line's own (le)."""
        out, running = [], 0
        for bound, count in zip((*self.buckets, float("inf")), self.counts):
            running += count
            out.append(f'{name}_bucket{{{labels}le="{"+Inf" if bound == float("inf") else bound}"}} {running}')
        tail = f"{{{labels.rstrip(',')}}}" if labels else ""
        return [*out, f"{name}_sum{tail} {self.total}", f"{name}_count{tail} {running}"]


OUTCOMES = ("finished", "aborted", "failed", "rejected")
HISTOGRAMS = (("time_to_first_token_seconds", "Seconds from a request's arrival to its first token"),
              ("request_seconds", "Seconds from a request's arrival to its last token"),
              ("step_seconds", "Seconds per engine step"),
              ("inter_token_seconds", "Seconds between a request's steps that gave it tokens"))
# vLLM's name -> ours: histograms, then (kind, help) of the counters and gauges render() reads from Metrics
VLLM_HISTOGRAMS = (("time_to_first_token_seconds", "time_to_first_token_seconds"),
                   ("inter_token_latency_seconds", "inter_token_seconds"),
                   ("e2e_request_latency_seconds", "request_seconds"))


class Metrics:

    def __init__(self, kv_budget_bytes: int, model_name: str = ""):
        self.lock = threading.Lock()
        self.model_name = model_name
        self.running_requests = 0
        self.prefix_queries = 0            # prompt tokens looked up in the prefix cache
        self.prefix_hits = 0               # of those, tokens it held
        self.requests = dict.fromkeys(OUTCOMES, 0)
        self.prompt_tokens = 0
        self.generation_tokens = 0
        self.preemptions = 0
        self.queue_depth = 0
        self.batch_rows = 0
        self.kv_bytes = 0
        self.kv_budget_bytes = kv_budget_bytes
        self.prompt_tokens_prefilled = 0   # of the requests in prefill
        self.prompt_tokens_pending = 0
        self.histograms = {name: Histogram() for name, _ in HISTOGRAMS}
        self.cache_config: dict = {}       # vllm:cache_config_info's labels (load_routes.py sets them)

    def count(self, outcome: str) -> None:
        with self.lock:
            self.requests[outcome] += 1

    def observe(self, histogram: str, seconds: float) -> None:
        with self.lock:
            self.histograms[histogram].observe(seconds)

    def render(self) -> str:
        with self.lock:
            lines = family("nanoinfer_requests_total", "counter", "Requests by outcome",
                           [f'nanoinfer_requests_total{{outcome="{k}"}} {v}' for k, v in self.requests.items()])
            for name, kind, value, help_text in (
                    ("prompt_tokens_total", "counter", self.prompt_tokens, "Prompt tokens of admitted requests"),
                    ("generation_tokens_total", "counter", self.generation_tokens, "Tokens generated"),
                    ("preemptions_total", "counter", self.preemptions, "Requests preempted for KV memory"),
                    ("queue_depth", "gauge", self.queue_depth, "Requests waiting for admission"),
                    ("batch_rows", "gauge", self.batch_rows, "Rows decoding together"),
                    ("kv_cache_bytes", "gauge", self.kv_bytes, "KV cache memory held"),
                    ("kv_cache_budget_bytes", "gauge", self.kv_budget_bytes, "KV cache memory bound"),
                    ("prompt_tokens_prefilled", "gauge", self.prompt_tokens_prefilled,
                     "Prompt tokens prefilled so far of the requests in prefill"),
                    ("prompt_tokens_pending", "gauge", self.prompt_tokens_pending,
                     "Prompt tokens still to prefill of the requests in prefill")):
                lines += family(f"nanoinfer_{name}", kind, help_text, [f"nanoinfer_{name} {value}"])
            for name, help_text in HISTOGRAMS:
                lines += family(f"nanoinfer_{name}", "histogram", help_text,
                                self.histograms[name].lines(f"nanoinfer_{name}"))
            lines += self._vllm_lines()
        return "\n".join(lines) + "\n"

    def _vllm_lines(self) -> list[str]:
        """The vLLM-named series (the caller holds the lock)."""
        label = f'model_name="{self.model_name}"'
        usage = self.kv_bytes / self.kv_budget_bytes if self.kv_budget_bytes else 0.0
        lines = []
        for name, kind, value, help_text in (
                ("num_requests_running", "gauge", self.running_requests, "Requests decoding"),
                ("num_requests_waiting", "gauge", self.queue_depth, "Requests waiting for admission"),
                ("kv_cache_usage_perc", "gauge", usage, "KV cache held, as a fraction of its bound (0: none)"),
                ("prompt_tokens_total", "counter", self.prompt_tokens, "Prompt tokens of admitted requests"),
                ("generation_tokens_total", "counter", self.generation_tokens, "Tokens generated"),
                ("num_preemptions_total", "counter", self.preemptions, "Requests preempted for KV memory"),
                ("prefix_cache_queries_total", "counter", self.prefix_queries, "Prompt tokens looked up"),
                ("prefix_cache_hits_total", "counter", self.prefix_hits, "Prompt tokens found cached")):
            lines += family(f"vllm:{name}", kind, help_text, [f"vllm:{name}{{{label}}} {value}"])
        for name, ours in VLLM_HISTOGRAMS:
            lines += family(f"vllm:{name}", "histogram", dict(HISTOGRAMS)[ours],
                            self.histograms[ours].lines(f"vllm:{name}", label + ","))
        if self.cache_config:              # an info gauge, as vLLM's: the value 1, the cache's shape in labels
            labels = ",".join(f'{key}="{value}"' for key, value in self.cache_config.items())
            lines += family("vllm:cache_config_info", "gauge", "Information of the KV cache config",
                            [f"vllm:cache_config_info{{{labels}}} 1"])
        return lines


def family(name: str, kind: str, help_text: str, samples: list[str]) -> list[str]:
    """One metric family in Prometheus' text format: its HELP and TYPE lines, then its samples."""
    return [f"# HELP {name} {help_text}", f"# TYPE {name} {kind}", *samples]
