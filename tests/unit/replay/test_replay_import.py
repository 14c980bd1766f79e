"""``fdsched trace import``: the public formats, the options, and one clear error per bad input. No host."""

from __future__ import annotations

import pytest

from fdsched.tools.cli import main
from fdsched.replay.importer import ImportError_, ImportOptions, import_trace, parse_columns, parse_max_tokens
from fdsched.replay.tracefile import load_trace

AZURE = """TIMESTAMP,ContextTokens,GeneratedTokens
2023-11-16 18:15:46.6805900,374,44
2023-11-16 18:15:50.9951690,396,109
2023-11-16 18:15:52.0000000,20000,50
2023-11-16 18:16:46.6805900,800,10
"""
BURST = """Timestamp,Model,Request tokens,Response tokens,Total tokens,Log Type
5,ChatGPT,472,18,490,Conversation log
45,ChatGPT,1087,230,1317,Conversation log
60,GPT-4,300,0,300,API log
118,GPT-4,417,276,693,Conversation log
"""
ENGINE = {"max_model_len": 4096, "num_gpu_blocks": 600}


def _import(tmp_path, text, fmt="azure", name="in.csv", **kw):
    src = tmp_path / name
    src.write_text(text, encoding="utf-8")
    out = tmp_path / "out.jsonl"
    result = import_trace(src, out, ImportOptions(fmt=fmt, engine=dict(ENGINE), **kw))
    return result, load_trace(out), out


def test_azure_rows_become_time_based_requests(tmp_path):
    result, trace, _ = _import(tmp_path, AZURE)
    assert trace.time_based and result.requests == 4
    first, second, long_one, last = trace.requests
    assert (first.arrival_s, first.prompt_len, first.output_len, first.max_tokens) == (0.0, 374, 44, None)
    assert second.arrival_s == pytest.approx(4.314579)
    assert last.arrival_s == pytest.approx(60.0)
    assert long_one.prompt_len + long_one.output_len <= 4096 and long_one.output_len == 50  # truncated prompt
    assert result.truncated == 1
    assert trace.generator["format"] == "azure" and "CC-BY-4.0" in trace.generator["source"]


def test_burstgpt_skips_failed_requests(tmp_path):
    result, trace, _ = _import(tmp_path, BURST, fmt="burstgpt")
    assert [r.output_len for r in trace.requests] == [18, 230, 276]
    assert [r.arrival_s for r in trace.requests] == [0.0, 40.0, 113.0]
    assert result.skipped_failed == 1


def test_failure_log_type_is_skipped_too(tmp_path):
    text = BURST.replace("45,ChatGPT,1087,230,1317,Conversation log", "45,ChatGPT,1087,230,1317,Failure log")
    result, trace, _ = _import(tmp_path, text, fmt="burstgpt")
    assert result.skipped_failed == 2 and len(trace.requests) == 2


def test_generic_with_a_column_map(tmp_path):
    text = "t,in,out,extra\n0.5,10,3,x\n1.5,20,4,y\n"
    _, trace, _ = _import(tmp_path, text, fmt="generic", columns=parse_columns("time=t,prompt=in,output=out"))
    assert [(r.arrival_s, r.prompt_len, r.output_len) for r in trace.requests] == [(0.0, 10, 3), (1.0, 20, 4)]


def test_window_rate_scale_limit_and_max_tokens(tmp_path):
    _, trace, _ = _import(tmp_path, BURST, fmt="burstgpt", start_s=40, duration_s=100, rate_scale=2.0,
                          max_tokens="true")
    assert [(r.arrival_s, r.max_tokens, r.output_len) for r in trace.requests] == [(0.0, 230, 230), (36.5, 276, 276)]
    _, trace, _ = _import(tmp_path, BURST, fmt="burstgpt", limit=1, max_tokens=100)
    assert [(r.id, r.max_tokens) for r in trace.requests] == [("q000000", 100)]


def test_sample_is_seeded(tmp_path):
    rows = "Timestamp,Model,Request tokens,Response tokens,Total tokens,Log Type\n" + "".join(
        f"{i},ChatGPT,10,5,15,API log\n" for i in range(200))
    a = [r.arrival_s for r in _import(tmp_path, rows, fmt="burstgpt", sample=0.3, seed=1)[1].requests]
    b = [r.arrival_s for r in _import(tmp_path, rows, fmt="burstgpt", sample=0.3, seed=1)[1].requests]
    c = [r.arrival_s for r in _import(tmp_path, rows, fmt="burstgpt", sample=0.3, seed=2)[1].requests]
    assert a == b and a != c and 30 < len(a) < 90


@pytest.mark.parametrize(
    "text, words",
    [
        ("TIMESTAMP,ContextTokens\n2023-11-16 18:15:46.1,3\n", ["in.csv:1", "'GeneratedTokens'", "missing from the header"]),
        (AZURE + "2023-11-16 18:17:00.0,12\n", ["in.csv:6", "'GeneratedTokens'", "truncated row", "allowed: 3"]),
        (AZURE.replace(",44\n", ",-4\n"), ["in.csv:2", "'GeneratedTokens'", "'-4'", "allowed: an integer >= 0"]),
        (AZURE.replace(",396,", ",many,"), ["in.csv:3", "'ContextTokens'", "'many'", "allowed: an integer >= 0"]),
        (AZURE.replace("2023-11-16 18:15:52.0000000", "2023-11-16 18:10:00.0"), ["in.csv:4", "'TIMESTAMP'",
                                                                              "earlier than the row before"]),
        (AZURE.replace("2023-11-16 18:15:50.9951690", "yesterday"), ["in.csv:3", "'TIMESTAMP'", "'yesterday'",
                                                                     "unparsable time", "allowed: a date and time"]),
        ('TIMESTAMP,ContextTokens,GeneratedTokens\n"2023-11-16 18:15:46.1,3,4\n', ["in.csv", "malformed CSV"]),
        ("", ["in.csv:1", "empty"]),
    ],
)
def test_bad_input_is_one_error_and_nothing_is_written(tmp_path, text, words):
    with pytest.raises(ImportError_) as info:
        _import(tmp_path, text)
    message = str(info.value)
    for word in words:
        assert word in message, message
    assert not (tmp_path / "out.jsonl").exists()
    assert [p.name for p in tmp_path.iterdir()] == ["in.csv"]  # no temporary file left behind


def test_an_empty_window_is_an_error(tmp_path):
    with pytest.raises(ImportError_, match="no requests in the window"):
        _import(tmp_path, AZURE, start_s=1000)


def test_a_failed_import_keeps_an_existing_trace(tmp_path):
    _, _, out = _import(tmp_path, AZURE)
    before = out.read_bytes()
    with pytest.raises(ImportError_):
        _import(tmp_path, AZURE.replace(",44\n", ",x\n"))
    assert out.read_bytes() == before


def test_utf16_and_directories_and_non_utf8_get_clear_errors(tmp_path):
    src = tmp_path / "win.csv"
    src.write_text(AZURE, encoding="utf-16")
    with pytest.raises(ImportError_, match="UTF-16.*allowed: UTF-8"):
        import_trace(src, tmp_path / "o.jsonl", ImportOptions(fmt="azure"))
    with pytest.raises(ImportError_, match="is a directory"):
        import_trace(tmp_path, tmp_path / "o.jsonl", ImportOptions(fmt="azure"))
    latin = tmp_path / "latin.csv"
    latin.write_bytes(AZURE.encode() + b"2023-11-16 18:17:00.0,3,4\xe9\n")
    with pytest.raises(ImportError_, match=r"latin.csv:\d+: not UTF-8"):
        import_trace(latin, tmp_path / "o.jsonl", ImportOptions(fmt="azure"))
    assert not (tmp_path / "o.jsonl").exists()


def test_a_utf8_bom_is_accepted(tmp_path):
    src = tmp_path / "bom.csv"
    src.write_bytes(b"\xef\xbb\xbf" + AZURE.encode())
    result = import_trace(src, tmp_path / "o.jsonl", ImportOptions(fmt="azure", engine=dict(ENGINE)))
    assert result.requests == 4


def test_option_parsers():
    assert parse_max_tokens("unset") == "unset" and parse_max_tokens("true") == "true" and parse_max_tokens("8") == 8
    for bad in ("0", "x", "-1"):
        with pytest.raises(ImportError_, match="allowed: unset, true"):
            parse_max_tokens(bad)
    with pytest.raises(ImportError_, match="missing output"):
        parse_columns("time=a,prompt=b")
    with pytest.raises(ImportError_, match="unknown role 'size'"):
        parse_columns("time=a,prompt=b,output=c,size=d")


def test_the_command(tmp_path, capsys):
    src = tmp_path / "b.csv"
    src.write_text(BURST, encoding="utf-8")
    out = tmp_path / "t.jsonl"
    assert main(["trace", "import", str(src), "--format", "burstgpt", "--out", str(out), "--max-model-len", "2048"]) == 0
    assert "3 requests" in capsys.readouterr().err
    assert load_trace(out).engine["max_model_len"] == 2048
    assert main(["trace", "import", str(tmp_path), "--format", "azure", "--out", str(out)]) == 1
    assert "is a directory" in capsys.readouterr().err


REAL_BURSTGPT = __import__("pathlib").Path(__file__).resolve().parents[1] / "data" / "BurstGPT_1-first400.csv"


def test_real_burstgpt_rows_import_to_the_shipped_trace(tmp_path):
    """The first 400 real rows of BurstGPT_1.csv (tests/unit/data, CC-BY-4.0) go through the importer as
    any operator's file would, and give exactly the requests of the shipped ``burstgpt`` trace."""
    from fdsched.replay.tracefile import resolve_trace

    shipped = load_trace(resolve_trace("burstgpt"))
    out = tmp_path / "bg.jsonl"
    result = import_trace(
        REAL_BURSTGPT, out, ImportOptions(fmt="burstgpt", rate_scale=600.0, engine=dict(shipped.engine)),
    )
    assert (result.rows_read, result.requests, result.skipped_failed) == (400, 383, 17)  # 17 rows logged 0 response tokens
    mine = load_trace(out)
    assert [(r.arrival_s, r.prompt_len, r.output_len, r.max_tokens) for r in mine.requests] == [
        (r.arrival_s, r.prompt_len, r.output_len, r.max_tokens) for r in shipped.requests
    ]
    # what the real slice looks like (BurstGPT's README shows these first rows)
    first = mine.requests[:3]
    assert [(r.prompt_len, r.output_len) for r in first] == [(472, 18), (1087, 230), (417, 276)]
    assert mine.requests[-1].arrival_s == pytest.approx((37274 - 5) / 600, abs=1e-3)
    assert shipped.generator["rate_scale"] == 600.0 and "CC-BY-4.0" in shipped.generator["source"]
