"""Packages, the way nginx modules ship (issue 19, section 5): one version
everywhere, the rockspec installs with Debian's luarocks, `make install`
and `make deb` give trees nginx loads, the .deb is shaped like Debian's
libnginx-mod-* packages and lintian finds no error in it."""

import glob
import os
import re
import shutil
import subprocess
import time
import urllib.error
import urllib.request

import pytest

from loomtest.nginx import (DEBIAN_NGINX, NGINX, NGINX_SRC, ROOT, free_port,
                            local_modules)

with open(os.path.join(ROOT, "src", "ngx_loom.h")) as f:
    VERSION = re.search(r'#define NGX_LOOM_VERSION\s+"([^"]+)"',
                        f.read()).group(1)
ROCKSPEC = os.path.join(ROOT, "lua-resty-loom-%s-1.rockspec" % VERSION)
LUA_FILES = sorted(os.path.relpath(p, os.path.join(ROOT, "lib"))
                   for p in glob.glob(os.path.join(ROOT, "lib", "resty",
                                                   "loom", "**", "*.lua"),
                                      recursive=True))
MODULES = [p[:-4].replace("/", ".") for p in LUA_FILES]
# drop-in stand-ins for the peers carry the peer's _VERSION (or are a
# function, as the peer's module is)
PEER_MODULES = {"resty.loom.compat.disable_listening",
                "resty.loom.compat.events", "resty.loom.compat.events_compat",
                "resty.loom.compat.worker_events"}
VERSIONED = [m for m in MODULES if m not in PEER_MODULES]
# these build the module themselves: against the source of the nginx under
# test (LOOM_NGINX_SRC), which must be known
needs_nginx_src = pytest.mark.skipif(
    NGINX_SRC is None, reason="LOOM_NGINX is not Debian's nginx: set "
    "LOOM_NGINX_SRC to its source tree to build the module against it")
debian_only = pytest.mark.skipif(
    NGINX != DEBIAN_NGINX, reason="the .deb is for Debian's nginx only")


def check_conf(tmp_path, load_module, lua_dir):
    """nginx -t, then nginx runs: its init_by_lua checks that every
    resty.loom module loads from lua_dir (and not from the checkout), and a
    request to a worker gets the version from the loaded C module. (nginx -t
    alone does not run init_by_lua.)"""
    prefix = str(tmp_path / "nginx")
    os.makedirs(prefix + "/logs")
    requires = "\n".join(
        'assert(package.searchpath("%s", package.path):find("%s", 1, true)'
        ', "%s")\nassert(require("%s")._VERSION == "%s", "%s")'
        % (m, lua_dir, m, m, VERSION, m) for m in VERSIONED)
    port = free_port()
    conf = local_modules("""
load_module /usr/share/nginx/modules/ndk_http_module.so;
load_module /usr/share/nginx/modules/ngx_http_lua_module.so;
%(load_module)s
pid %(prefix)s/nginx.pid;
error_log %(prefix)s/logs/error.log;
events {}
http {
    access_log off;
    lua_package_path "%(lua_dir)s/?.lua;;";
    init_by_lua_block {
%(requires)s
    }
    server {
        listen 127.0.0.1:%(port)d;
        location = /version {
            content_by_lua_block {
                local ffi = require "ffi"
                ffi.cdef("const char *ngx_loom_ffi_version(void);")
                ngx.print(ffi.string(ffi.C.ngx_loom_ffi_version()))
            }
        }
    }
}
""") % {"load_module": load_module, "prefix": prefix, "lua_dir": lua_dir,
         "requires": requires, "port": port}
    with open(prefix + "/nginx.conf", "w") as f:
        f.write(conf)
    cmd = [NGINX, "-p", prefix, "-c", prefix + "/nginx.conf",
           "-e", prefix + "/logs/error.log"]
    res = subprocess.run(cmd + ["-t"], capture_output=True, text=True,
                         timeout=60)
    assert res.returncode == 0, res.stderr
    assert "test is successful" in res.stderr
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, res.stderr
    try:
        deadline = time.monotonic() + 10
        while True:
            try:
                with urllib.request.urlopen("http://127.0.0.1:%d/version"
                                            % port, timeout=5) as r:
                    assert r.read().decode() == VERSION
                break
            except urllib.error.URLError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.1)
    finally:
        subprocess.run(cmd + ["-s", "quit"], capture_output=True,
                       timeout=60)
    with open(prefix + "/logs/error.log") as f:
        bad = [line for line in f
               if re.search(r"\[(error|crit|alert|emerg)\]", line)]
    assert not bad, bad


def test_one_version_everywhere():
    for path in LUA_FILES:
        if path[:-4].replace("/", ".") in PEER_MODULES:
            continue
        with open(os.path.join(ROOT, "lib", path)) as f:
            found = re.findall(r'_VERSION = "([^"]+)"', f.read())
        assert found == [VERSION], (path, found)
    with open(os.path.join(ROOT, "dist.ini")) as f:
        assert re.search(r"^version = %s$" % re.escape(VERSION), f.read(),
                         re.M)
    with open(ROCKSPEC) as f:
        assert 'version = "%s-1"' % VERSION in f.read()
    assert glob.glob(os.path.join(ROOT, "*.rockspec")) == [ROCKSPEC]


def test_c_module_reports_its_version(nginx):
    n = nginx(server="""
location = /v {
    content_by_lua_block {
        local ffi = require "ffi"
        ffi.cdef("const char *ngx_loom_ffi_version(void);")
        ngx.say(ffi.string(ffi.C.ngx_loom_ffi_version()))
    }
}""")
    assert n.get("/v").text.strip() == VERSION


def test_rockspec_lists_every_module():
    with open(ROCKSPEC) as f:
        listed = dict(re.findall(r'\["([\w.]+)"\] = "(lib/[\w/]+\.lua)"',
                                 f.read()))
    assert sorted(listed) == sorted(MODULES)
    for mod, path in listed.items():
        assert path == "lib/" + mod.replace(".", "/") + ".lua"


@needs_nginx_src
def test_luarocks_make_local(tmp_path):
    """The rock builds the nginx module itself: luarocks make in a copy of
    the checkout without its build/, then nginx loads the
    ngx_loom_module.so the rock installed."""
    src = str(tmp_path / "src")
    files = subprocess.run(["git", "ls-files", "-co", "--exclude-standard"],
                           cwd=ROOT, capture_output=True, text=True,
                           check=True).stdout.split()
    for path in files:
        if os.path.isfile(os.path.join(ROOT, path)):
            os.makedirs(os.path.dirname(os.path.join(src, path)),
                        exist_ok=True)
            shutil.copy2(os.path.join(ROOT, path), os.path.join(src, path))
    assert not os.path.exists(src + "/build")
    home = str(tmp_path / "home")
    os.makedirs(home)
    res = subprocess.run(["luarocks", "make", "--local",
                          os.path.basename(ROCKSPEC)],
                         cwd=src, env=dict(os.environ, HOME=home,
                                           NGINX_SRC=NGINX_SRC),
                         capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stdout + res.stderr
    assert "built %s/build/ngx_loom_module.so" % src in res.stdout
    tree = home + "/.luarocks"
    module = tree + "/lib/lua/5.1/ngx_loom_module.so"
    assert os.path.isfile(module)
    check_conf(tmp_path, "load_module %s;" % module, tree + "/share/lua/5.1")


@needs_nginx_src
def test_make_install(tmp_path):
    prefix = str(tmp_path / "usr" / "local")
    # its own build/ unless the nginx under test is Debian's (whose module
    # the suite's build/ already holds)
    build = [] if NGINX == DEBIAN_NGINX else [
        "BUILD_DIR=" + str(tmp_path / "build"), "NGINX_SRC=" + NGINX_SRC]
    res = subprocess.run(["make", "-s", "-C", ROOT, "install",
                          "PREFIX=" + prefix] + build,
                         capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stdout + res.stderr
    for path in ("include/loom_offload.h",
                 "share/doc/lua-resty-loom/README.md",
                 "share/doc/lua-resty-loom/LICENSE"):
        assert os.path.isfile(os.path.join(prefix, path)), path
    check_conf(tmp_path, "load_module %s/lib/nginx/modules/ngx_loom_module.so;"
               % prefix, prefix + "/share/lua/5.1")


@pytest.fixture(scope="module")
def deb():
    res = subprocess.run(["make", "-s", "-C", ROOT, "deb"],
                         capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stdout + res.stderr
    arch = subprocess.run(["dpkg", "--print-architecture"],
                          capture_output=True, text=True).stdout.strip()
    path = os.path.join(ROOT, "build", "libnginx-mod-http-loom_%s-1_%s.deb"
                        % (VERSION, arch))
    assert os.path.isfile(path)
    return path


@debian_only
def test_deb_is_shaped_like_debians_modules(deb):
    def field(name):
        return subprocess.run(["dpkg-deb", "-f", deb, name],
                              capture_output=True, text=True,
                              check=True).stdout.strip()
    assert field("Package") == "libnginx-mod-http-loom"
    assert field("Version") == VERSION + "-1"
    provides = subprocess.run(["dpkg-query", "-W", "-f=${Provides}",
                               "nginx"], capture_output=True, text=True,
                              check=True).stdout
    abi = re.search(r"nginx-abi-[^\s,]+", provides).group(0)
    depends = [d.strip() for d in field("Depends").split(",")]
    assert abi in depends
    assert "libnginx-mod-http-lua" in depends
    files = subprocess.run(["dpkg-deb", "-c", deb], capture_output=True,
                           text=True, check=True).stdout
    paths = [line.split()[-1] for line in files.splitlines()]
    assert "./usr/lib/nginx/modules/ngx_loom_module.so" in paths
    assert "./usr/share/nginx/modules-available/mod-http-loom.conf" in paths
    for lua in LUA_FILES:
        assert "./usr/share/lua/5.1/" + lua in paths, lua


@debian_only
def test_lintian_finds_no_error(deb):
    res = subprocess.run(["lintian", deb], capture_output=True, text=True,
                         timeout=300)
    errors = [line for line in res.stdout.splitlines()
              if line.startswith("E:")]
    assert not errors, res.stdout
    assert res.returncode == 0, res.stdout + res.stderr


@debian_only
def test_deb_unpacked_runs_nginx_t(deb, tmp_path):
    root = str(tmp_path / "root")
    subprocess.run(["dpkg", "-x", deb, root], check=True)
    with open(root + "/usr/share/nginx/modules-available/"
                     "mod-http-loom.conf") as f:
        assert f.read().strip() == "load_module modules/ngx_loom_module.so;"
    check_conf(tmp_path, "load_module %s/usr/lib/nginx/modules/"
               "ngx_loom_module.so;" % root, root + "/usr/share/lua/5.1")
