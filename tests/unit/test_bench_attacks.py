"""The attacks bench phase's report, from made-up measurements (no stack): b's p50 against the
alone and control rows, b's errors, attacks refused up front, and the targets judged on them."""
from __future__ import annotations

import pytest

from bench.attacks import ROWS, attack_targets, format_attacks, summarize
from bench.bench import parse_args


def row(kind: str, latencies, errors=None, a_answers=None) -> dict:
    return {"kind": kind, "latencies": list(latencies), "errors": dict(errors or {}),
            "a_answers": dict(a_answers or {})}


def test_ratios_are_over_the_alone_and_control_p50s():
    got = summarize([row("alone", [0.3, 0.4, 0.5]), row("control", [1.9, 2.0, 2.1]),
                     row("costly_schema", [3.0, 5.0, 4.0], a_answers={"200": 7}),
                     row("waiting_generate", [26.0], a_answers={"200": 40, "429": 3})], 60)
    by = {r["kind"]: r for r in got["rows"]}
    assert got["seconds"] == 60
    assert by["alone"]["b_p50_s"] == 0.4 and by["alone"]["x_alone"] == 1.0
    assert by["control"]["x_alone"] == 5.0 and by["control"]["x_control"] == 1.0
    assert by["costly_schema"]["b_p50_s"] == 4.0
    assert by["costly_schema"]["x_alone"] == 10.0 and by["costly_schema"]["x_control"] == 2.0
    assert by["waiting_generate"]["x_control"] == 13.0
    assert not by["waiting_generate"]["refused_up_front"]
    # 2.0 x the control is within the bar; 13 x is not.
    assert [(t["value"], t["met"]) for t in attack_targets(got)] == [(2.0, True), (13.0, False)]


def test_an_error_for_b_fails_the_row_whatever_its_latency():
    got = summarize([row("alone", [0.4]), row("control", [2.0]),
                     row("waiting_generate", [0.5, 0.6, 0.7], errors={"429 queue_full": 2},
                         a_answers={"200": 300})], 10)
    wave = got["rows"][-1]
    assert wave["b_errors"] == 2 and wave["b_requests"] == 5
    assert wave["b_error_kinds"] == {"429 queue_full": 2}
    assert [t["met"] for t in attack_targets(got)] == [False]


def test_an_attack_answered_400_every_time_is_refused_up_front():
    got = summarize([row("alone", [0.4]), row("control", [2.0]),
                     row("logit_bias", [0.5], a_answers={"400": 120}),
                     row("stop_token_ids", [0.5], a_answers={"400": 119, "200": 1})], 10)
    by = {r["kind"]: r for r in got["rows"]}
    assert by["logit_bias"]["refused_up_front"]
    assert not by["stop_token_ids"]["refused_up_front"]   # one got through
    assert not by["alone"]["refused_up_front"]            # a sent nothing
    text = "\n".join(format_attacks(got))
    assert "refused up front (400)" in text and "200: 1, 400: 119" in text


def test_without_a_control_or_b_answers_the_ratio_is_unknown_not_met():
    got = summarize([row("alone", [0.4]), row("webhook_tarpit", [], errors={"500": 1})], 10)
    tarpit = got["rows"][-1]
    assert tarpit["b_p50_s"] is None and tarpit["x_control"] is None
    assert attack_targets(got) == [{"name": attack_targets(got)[0]["name"], "value": None,
                                    "met": None}]
    assert "-" in format_attacks(got)[-1]
    assert attack_targets(None) == [] and format_attacks(None) == []


def test_the_phase_runs_small_and_its_rows_can_be_chosen():
    args = parse_args(["--only", "attacks", "--attack-seconds", "10",
                       "--attacks", "alone,control,costly_schema"])
    assert args.attack_seconds == 10 and args.attacks == ["alone", "control", "costly_schema"]
    assert parse_args(["--only", "attacks"]).attacks == list(ROWS)
    assert parse_args(["--only", "attacks"]).attack_seconds == 60
    with pytest.raises(SystemExit):
        parse_args(["--only", "attacks", "--attacks", "alone,nope"])
