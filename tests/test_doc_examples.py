"""Every fenced example in README.md and docs/*.md runs as written.

The markers, the grouping into examples and the substitutions are defined in
docs/development.md ("Doc examples").
"""

import glob
import os
import re
import shutil
import signal
import socket
import subprocess
import tempfile
import time

import pytest

from loomtest.nginx import (BAD_LOG, NGINX, ROOT, free_port, local_modules,
                            readable_checkout)

RUN_LANGS = {"nginx", "lua", "sh", "rust", "go", "go-mod", "python", "c",
             "toml", "java"}
COMMENT = {"nginx": "#", "sh": "#", "python": "#", "toml": "#",
           "lua": "--", "rust": "//", "go": "//", "go-mod": "//", "c": "//",
           "java": "//"}
# the Debian package of each program a `run` block may name, for the reason
# the example is skipped without it
DEBIAN_PACKAGE = {"cc": "gcc", "gcc": "gcc", "cargo": "cargo",
                  "go": "golang-go", "javac": "openjdk-17-jdk-headless",
                  "curl": "curl", "redis-server": "redis-server",
                  "redis-cli": "redis-tools"}
PAGES = ["README.md"] + sorted(
    os.path.relpath(p, ROOT) for p in glob.glob(os.path.join(ROOT, "docs",
                                                             "*.md")))
FENCE = re.compile(r"^(`{3,}|~{3,})\s*([\w+-]*)\s*$")
PORT_RX = re.compile(r"(?<![\w.])(?:(?:127\.0\.0\.1|localhost):)?8080\b")
CHECK_RX = re.compile(r"^# => (.*)$")


class Block:
    def __init__(self, page, line, lang, text, section):
        self.page, self.line, self.lang = page, line, lang
        self.text, self.section = text, section
        self.role, self.arg = self._marker()

    @property
    def name(self):
        return "%s:%d" % (self.page, self.line)

    def _marker(self):
        first = self.text.split("\n", 1)[0].strip()
        m = re.match(r"^(#|--|//)\s*doc-test:\s*(\S+?)(?::|\s|$)\s*(.*)$",
                     first)
        if m:
            return m.group(2), m.group(3).strip()
        return {"nginx": "nginx.conf", "lua": "content"}.get(
            self.lang), ""

    def body(self):
        """The text without its marker line."""
        if self.text.lstrip().startswith(COMMENT.get(self.lang, "#") +
                                         " doc-test:"):
            return self.text.split("\n", 1)[1] if "\n" in self.text else ""
        return self.text


def blocks_of(page):
    out = []
    with open(os.path.join(ROOT, page)) as f:
        lines = f.read().split("\n")
    section = ""
    i = 0
    while i < len(lines):
        m = FENCE.match(lines[i])
        if not m:
            if lines[i].startswith("## "):
                section = lines[i]
            i += 1
            continue
        fence, lang, start = m.group(1), m.group(2), i + 1
        i += 1
        body = []
        while i < len(lines) and not (lines[i].startswith(fence) and
                                      lines[i].strip() == fence):
            body.append(lines[i])
            i += 1
        i += 1
        if lang in RUN_LANGS:
            out.append(Block(page, start, lang, "\n".join(body), section))
    return out


def examples():
    """One pytest parameter per example (docs/development.md)."""
    params = []
    for page in PAGES:
        blocks = blocks_of(page)
        sections = {}
        for b in blocks:
            if b.role in ("skip", "fragment") or b.role is None:
                params.append(pytest.param([b], blocks, id=b.name))
            elif b.role == "content":
                params.append(pytest.param([b], blocks, id=b.name))
            else:
                group = sections.get(b.section)
                if group is None:
                    group = sections[b.section] = []
                    params.append(pytest.param(group, blocks, id=b.name))
                group.append(b)
    return params


def substitute(text, prefix, port):
    text = local_modules(text)
    text = text.replace("/path/to/resty-loom", readable_checkout())
    text = text.replace("/run/myapp", os.path.join(prefix, "run"))
    return PORT_RX.sub("127.0.0.1:%d" % port, text)


HTTP_ADDITIONS = """\
    access_log {p}/logs/access.log;
    client_body_temp_path {p}/tmp/body;
    proxy_temp_path {p}/tmp/proxy;
    fastcgi_temp_path {p}/tmp/fastcgi;
    uwsgi_temp_path {p}/tmp/uwsgi;
    scgi_temp_path {p}/tmp/scgi;
"""

CONTENT_CONF = """\
load_module /usr/share/nginx/modules/ndk_http_module.so;
load_module /usr/share/nginx/modules/ngx_http_lua_module.so;
load_module /path/to/resty-loom/build/ngx_loom_module.so;
events {{}}
http {{
    lua_package_path "/path/to/resty-loom/lib/?.lua;;";
    server {{
        listen 8080;
        location = /t {{
            content_by_lua_block {{
{code}
            }}
        }}
    }}
}}
"""


class Example:
    def __init__(self, blocks):
        self.blocks = blocks
        self.dir = tempfile.mkdtemp(prefix="loom-doc-")
        os.chmod(self.dir, 0o755)
        for d in ("logs", "tmp", "run"):
            os.makedirs(os.path.join(self.dir, d))
        self.port = free_port()
        self.master = None

    def sub(self, text):
        return substitute(text, self.dir, self.port)

    def write(self, path, text):
        full = os.path.join(self.dir, path)
        os.makedirs(os.path.dirname(full), exist_ok=True)
        with open(full, "w") as f:
            f.write(text + "\n")

    def nginx_conf(self, text):
        text = self.sub(text)
        add = HTTP_ADDITIONS.format(p=self.dir)
        text, n = re.subn(r"^(http\s*\{[^\n]*\n)", lambda m: m.group(1) + add,
                          text, count=1, flags=re.M)
        assert n == 1, "no `http {` block in the nginx.conf"
        self.write("nginx.conf", text)

    def nginx(self, *args):
        return subprocess.run(
            [NGINX, "-p", self.dir + "/", "-c", self.dir + "/nginx.conf",
             "-e", self.dir + "/logs/error.log",
             "-g", "pid %s/nginx.pid;" % self.dir] + list(args),
            capture_output=True, text=True, timeout=60)

    def start(self):
        res = self.nginx("-t")
        if res.returncode != 0:
            pytest.fail("nginx -t failed:\n" + res.stderr, pytrace=False)
        res = self.nginx()
        if res.returncode != 0:
            pytest.fail("nginx failed to start:\n%s%s" % (
                res.stderr, self.error_log()), pytrace=False)
        deadline = time.time() + 15
        while True:
            try:
                with open(self.dir + "/nginx.pid") as f:
                    self.master = int(f.read())
                socket.create_connection(("127.0.0.1", self.port), 1).close()
                return
            except (OSError, ValueError):
                assert time.time() < deadline, \
                    "nginx does not listen:\n" + self.error_log()
                time.sleep(0.05)

    def stop(self):
        if self.master is None:
            return
        master, self.master = self.master, None
        try:
            os.kill(master, signal.SIGQUIT)
        except ProcessLookupError:
            return
        deadline = time.time() + 20
        while os.path.exists("/proc/%d" % master):
            if time.time() > deadline:
                os.killpg(os.getpgid(master), signal.SIGKILL)
                raise AssertionError("nginx did not quit within 20 s")
            time.sleep(0.05)

    def kill_left_behind(self):
        """Kills what a run block started in the example's directory and
        left running (a daemonized redis-server when a later block failed
        before the example's own clean-up): it would keep its port and data
        for the next run."""
        for pid in os.listdir("/proc"):
            if not pid.isdigit():
                continue
            try:
                cwd = os.readlink("/proc/%s/cwd" % pid)
            except OSError:
                continue
            if cwd == self.dir or cwd.startswith(self.dir + "/"):
                try:
                    os.kill(int(pid), signal.SIGKILL)
                except ProcessLookupError:
                    pass

    def error_log(self):
        try:
            with open(self.dir + "/logs/error.log", errors="replace") as f:
                return f.read()
        except OSError:
            return ""

    def run_sh(self, block):
        """Runs a `run` block; checks each `# =>` line against the output of
        the commands before it."""
        script, checks = [], []
        for line in self.sub(block.body()).split("\n"):
            m = CHECK_RX.match(line)
            if m:
                checks.append(m.group(1))
                script.append("echo '@@doc-test-check@@'")
            else:
                script.append(line)
        assert checks, "%s: a run block needs a `# => <regex>` check" % (
            block.name)
        env = dict(os.environ, PATH="/usr/bin:/bin:/usr/sbin:/sbin:" +
                   os.environ.get("PATH", ""))
        res = subprocess.run(["bash", "-e", "-c", "\n".join(script)],
                             cwd=self.dir, env=env, capture_output=True,
                             text=True, timeout=300)
        if res.returncode != 0:
            pytest.fail("%s exited %d:\n%s%s" % (
                block.name, res.returncode, res.stdout, res.stderr),
                pytrace=False)
        parts = res.stdout.split("@@doc-test-check@@\n")
        for rx, part in zip(checks, parts):
            if not re.search(rx, part, re.M):
                pytest.fail("%s: output does not match %r:\n%s\n(stderr: "
                            "%s)" % (block.name, rx, part, res.stderr),
                            pytrace=False)

    def check_log(self):
        bad = [line for line in self.error_log().splitlines()
               if BAD_LOG.search(line)]
        if bad:
            pytest.fail("error log:\n" + "\n".join(bad[:20]), pytrace=False)


def check_fragment(block, page_blocks):
    earlier = "\n".join(b.text for b in page_blocks if b.line < block.line)
    for line in block.body().split("\n"):
        line = line.strip()
        if line and line != "...":
            assert line in earlier, "%s: %r is not in an earlier block" % (
                block.name, line)


def needs_runtimes(text):
    """Runtime libraries an example loads that are not built."""
    return [p for p in re.findall(r"/path/to/resty-loom/(runtimes/\S+?\.so)",
                                  text)
            if not os.path.exists(os.path.join(ROOT, p))]


@pytest.mark.parametrize("group,page_blocks", examples())
def test_doc_example(group, page_blocks):
    run_example(group, page_blocks)


def run_example(group, page_blocks):
    first = group[0]
    if first.role is None:
        pytest.fail("%s: a `%s` block needs a marker on its first line "
                    "(docs/development.md, Doc examples)" % (first.name,
                                                             first.lang))
    if first.role == "skip":
        assert first.arg, "%s: `doc-test: skip:` needs a reason" % first.name
        pytest.skip(first.arg)
    if first.role == "fragment":
        return check_fragment(first, page_blocks)
    unknown = [b.name for b in group
               if b.role not in ("nginx.conf", "content", "file", "run")]
    assert not unknown, "unknown doc-test role in %s" % unknown
    confs = [b for b in group if b.role in ("nginx.conf", "content")]
    assert len(confs) <= 1, "more than one nginx.conf in one section: %s" % (
        [b.name for b in confs])
    missing = needs_runtimes("\n".join(b.text for b in group))
    if missing:
        pytest.skip("not built: %s (make runtimes)" % ", ".join(missing))
    tools = [t for b in group if b.role == "run" for t in b.arg.split()]
    unknown = [t for t in tools if t not in DEBIAN_PACKAGE]
    assert not unknown, "%s: no Debian package known for %s (add it to " \
        "DEBIAN_PACKAGE)" % (first.name, unknown)
    missing = ["%s (Debian package %s)" % (t, DEBIAN_PACKAGE[t])
               for t in tools if not shutil.which(t)]
    if missing:
        pytest.skip("not installed: %s" % ", ".join(missing))

    ex = Example(group)
    try:
        for b in group:
            if b.role == "file":
                assert b.arg, "%s: `file` needs a path" % b.name
                ex.write(b.arg, ex.sub(b.body()))
        # in page order: a run block before the nginx.conf (a build, say)
        # runs before nginx starts, one after it against the running nginx
        for b in group:
            if b.role == "run":
                ex.run_sh(b)
            elif b.role == "nginx.conf":
                ex.nginx_conf(b.body())
                ex.start()
            elif b.role == "content":
                code = "\n".join(" " * 16 + line
                                 for line in b.body().split("\n"))
                ex.nginx_conf(CONTENT_CONF.format(code=code))
                ex.start()
                out = subprocess.run(
                    ["curl", "-s", "-o", "/dev/null", "-w", "%{http_code}",
                     "http://127.0.0.1:%d/t" % ex.port],
                    capture_output=True, text=True, timeout=30).stdout
                assert out == "200", "%s answered %s:\n%s" % (
                    first.name, out, ex.error_log())
        ex.stop()
        ex.check_log()
    finally:
        try:
            ex.stop()
        finally:
            ex.kill_left_behind()
            subprocess.run(["rm", "-rf", ex.dir])


SELF_TEST = """
## Synopsis

```sh
# doc-test: run gcc
printf 'const char *answer(void) { return "%s"; }' > answer.c
gcc -shared -fPIC -o answer.so answer.c && echo built
# => ^built$
```

```nginx
load_module /usr/share/nginx/modules/ndk_http_module.so;
load_module /usr/share/nginx/modules/ngx_http_lua_module.so;
events {}
http {
    server {
        listen 8080;
        location = /t {
            content_by_lua_block {
                local ffi = require "ffi"
                ffi.cdef("const char *answer(void);")
                local lib = ffi.load(ngx.config.prefix() .. "answer.so")
                ngx.say(ffi.string(lib.answer()))
            }
        }
    }
}
```

```sh
# doc-test: run
curl -s http://127.0.0.1:8080/t
# => ^%s$
```
"""


@pytest.mark.parametrize("says,expects,passes", [("42", "42", True),
                                                 ("42", "43", False)])
def test_the_checker_itself(tmp_path, says, expects, passes):
    """A build before nginx, nginx, a check after: the right output
    passes, a wrong one fails."""
    page = tmp_path / "page.md"
    page.write_text(SELF_TEST % (says, expects))
    blocks = blocks_of(str(page))
    assert [b.role for b in blocks] == ["run", "nginx.conf", "run"]
    if passes:
        run_example(blocks, blocks)
    else:
        with pytest.raises(pytest.fail.Exception, match="does not match"):
            run_example(blocks, blocks)


RULES = [
    # (page text, None if it passes or the message its failure contains)
    ("```nginx\nevents {}\n```\n\n```nginx\n# doc-test: fragment\n"
     "events {}\n```\n", None),
    ("```nginx\nevents {}\n```\n\n```nginx\n# doc-test: fragment\n"
     "http {}\n```\n", "is not in an earlier block"),
    ("```sh\nls\n```\n", "needs a marker"),
    ("```sh\n# doc-test: skip:\nls\n```\n", "needs a reason"),
    ("```sh\n# doc-test: run\nls\n```\n", "needs a `# => <regex>` check"),
    ("```sh\n# doc-test: frobnicate\nls\n```\n", "unknown doc-test role"),
    ("```sh\n# doc-test: run frob\nls\n# => .\n```\n",
     "no Debian package known for ['frob']"),
]


@pytest.mark.parametrize("text,failure", RULES)
def test_marker_rules(tmp_path, text, failure):
    page = tmp_path / "page.md"
    page.write_text(text)
    blocks = blocks_of(str(page))
    last = [blocks[-1]]
    if failure is None:
        run_example(last, blocks)
        return
    with pytest.raises((pytest.fail.Exception, AssertionError),
                       match=re.escape(failure)):
        run_example(last, blocks)


def test_a_missing_build_tool_skips_naming_its_package(tmp_path,
                                                       monkeypatch):
    page = tmp_path / "page.md"
    page.write_text("```sh\n# doc-test: run go\ngo version\n# => go\n```\n")
    blocks = blocks_of(str(page))
    monkeypatch.setattr(shutil, "which", lambda program: None)
    with pytest.raises(pytest.skip.Exception,
                       match=re.escape("not installed: go (Debian package "
                                       "golang-go)")):
        run_example(blocks, blocks)
