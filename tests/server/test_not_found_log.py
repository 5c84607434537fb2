"""404 log lines: each path once, at most LINES_PER_MINUTE a minute, the rest counted on the next line."""

from __future__ import annotations

import logging

from server.not_found_log import NotFoundLog


def test_each_path_once_at_a_bounded_rate(caplog):
    now = [0.0]
    log = NotFoundLog(max_paths=3, per_minute=2, clock=lambda: now[0])
    with caplog.at_level(logging.WARNING, logger="prescient.server"):
        for path in ["/a", "/a", "/b", "/c", "/d", "/a"]:
            log.record("GET", path)
        assert [r.getMessage() for r in caplog.records] == ["404: no route GET /a", "404: no route GET /b"]
        now[0] = 61.0  # a new minute: the next new path is logged, with the count of those that were not
        log.record("GET", "/c")
        assert caplog.records[-1].getMessage() == (
            "404: no route GET /c (2 more 404s on new paths were not logged)"
        )
        log.record("GET", "/c\n forged line")
        assert "\\n" in caplog.records[-1].getMessage()  # escaped: a path cannot forge a log line
