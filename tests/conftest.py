import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))

from loomtest.nginx import Nginx  # noqa: E402
from loomtest.gateway import Gateway  # noqa: E402


@pytest.fixture
def nginx(request):
    """Factory: nginx(workers=.., http=.., server=.., ...) -> started Nginx.

    Every instance is stopped at teardown, and the test fails when its
    error log has an [error], [crit], [alert] or [emerg] line that was not
    allowed with allow_log().
    """
    made = []

    def factory(start=True, **kw):
        n = Nginx(**kw)
        made.append(n)
        if start:
            n.start()
        return n

    yield factory

    problems = []
    for n in made:
        n.send_quit()
    for n in made:
        try:
            n.stop()
        except RuntimeError as e:
            problems.append(str(e))
        bad = n.bad_log_lines()
        if bad:
            problems.append("unexpected error-log lines in %s:\n%s" % (
                n.prefix, "\n".join(bad[:20])))
        failed = getattr(request.node, "rep_call", None)
        keep = bool(problems) or (failed is not None and failed.failed)
        n.cleanup(keep=keep)
    if problems:
        pytest.fail("\n".join(problems), pytrace=False)


@pytest.hookimpl(tryfirst=True, hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    rep = outcome.get_result()
    setattr(item, "rep_" + rep.when, rep)


@pytest.fixture
def gateway():
    """The example gateway on a free port; its log is checked at teardown
    like the nginx fixture's."""
    g = Gateway().start()
    yield g
    g.stop()
    bad = g.bad_log_lines()
    if bad:
        pytest.fail("unexpected gateway log lines:\n" + "\n".join(bad[:20]),
                    pytrace=False)
