"""Self-speculative decoding made visible (spec §8, §17.3; worker protocol §4.6): the done
record's counts reach usage and /metrics, the setting reaches the llama worker, and the
startup log describes the ready record's `speculative` object."""

import json

from trioserve.api.answers import openai_usage
from trioserve.api.responses.adapter import _usage as responses_usage
from trioserve.config import Settings
from trioserve.core.pipeline import usage_of
from trioserve.http.metrics import Metrics
from trioserve.core.stats import GenerationStats
from trioserve.worker.supervisor import describe_speculation
from trioserve.worker.protocol import Done, decode_record
from trioserve.worker.launch import argv_for


def _done(**extra) -> Done:
    line = {"type": "done", "id": 1, "finish_reason": "stop", "cancelled": False,
            "stop_string": None, "prompt_tokens": 10, "completion_tokens": 40, **extra}
    rec = decode_record(json.dumps(line).encode())
    assert isinstance(rec, Done)
    return rec


def test_drafted_counts_reach_usage_as_prediction_tokens():
    u = usage_of(_done(drafted_tokens=30, accepted_draft_tokens=24, draft_steps=5))
    chat = openai_usage(u)
    assert chat["completion_tokens_details"] == {"accepted_prediction_tokens": 24,
                                                 "rejected_prediction_tokens": 6}
    assert chat["completion_tokens"] == 40  # the counts never change the token count
    details = responses_usage(u)["output_tokens_details"]
    assert details["accepted_prediction_tokens"] == 24 and details["rejected_prediction_tokens"] == 6
    # Not drafted (speculation off, a grammar): no details at all, not zeros.
    plain = openai_usage(usage_of(_done()))
    assert "completion_tokens_details" not in plain
    assert responses_usage(usage_of(_done()))["output_tokens_details"] == {"reasoning_tokens": 0}


def _stats(**kw) -> GenerationStats:
    base = dict(request_id="r", prompt_tokens=10, cached_tokens=0, completion_tokens=40,
                ttft_ms=1.0, decode_tps=None, finish_reason="stop", cancelled=False)
    return GenerationStats(**{**base, **kw})


def test_metrics_count_drafted_and_accepted_and_the_acceptance_histogram():
    m = Metrics(queued=lambda: 0, running=lambda: 0, restarts=lambda: 0, ready=lambda: True)
    m.observe_generation(_stats(drafted_tokens=20, accepted_draft_tokens=15))
    m.observe_generation(_stats(drafted_tokens=10, accepted_draft_tokens=1))
    m.observe_generation(_stats())  # not drafted: counts nothing
    m.observe_generation(_stats(drafted_tokens=0, accepted_draft_tokens=0))  # never paid
    text = m.render().decode()
    assert "trioserve_drafted_tokens_total 30.0" in text
    assert "trioserve_accepted_draft_tokens_total 16.0" in text
    assert "trioserve_draft_acceptance_ratio_count 2.0" in text
    assert 'trioserve_draft_acceptance_ratio_bucket{le="0.1"} 1.0' in text
    assert 'trioserve_draft_acceptance_ratio_bucket{le="0.8"} 2.0' in text


def test_setting_reaches_the_llama_worker():
    def argv(s: Settings) -> list[str]:
        return argv_for(s.model_copy(update={"worker_bin": "/w", "model_path": "/m.gguf"}))

    default = argv(Settings())
    assert default[default.index("--speculative") + 1] == Settings().speculative
    off = argv(Settings.from_env({"TRIOSERVE_SPECULATIVE": "off"}))
    assert off[off.index("--speculative") + 1] == "off"
    fake = argv_for(Settings(engine="fake", worker_bin="/f"))
    assert "--speculative" not in fake  # the fake reports mode "off" in its ready record


def test_startup_log_describes_speculation():
    assert describe_speculation({}) == ""
    assert describe_speculation({"speculative": {"mode": "off"}}) == "; speculative decoding off"
    # Asked for, but the worker's start-up check found verification inexact: it says why.
    assert describe_speculation({"speculative": {"mode": "off", "off_reason": "logits differ"}}) == (
        "; speculative decoding off, although asked for: logits differ")
    text = describe_speculation({"speculative": {
        "mode": "auto", "draft_max": 12, "global_index_tokens": 262144,
        "global_index_bytes": 262144 * 20, "step_cost_ms": [[1, 9.5], [8, 12.25]]}})
    assert text == ("; speculative decoding auto (drafts up to 12 tokens, global index 262144 tokens / "
                    "5.0 MiB, step ms by tokens 1:9.5 8:12.2)")
