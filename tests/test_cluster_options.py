"""resty.loom.cluster: option validation, the janitor for groups of nodes
that left, and XAUTOCLAIM of a dead node's "one" entries."""

import time

from clusterconf import (need_redis, redis_factory, start_node,  # noqa: F401
                         wait_readers, stats, handled, publish, wait_tally)

BAD = [
    ("nil", "opts must be a table"),
    ("{}", "opts.redis is required"),
    ("{redis = {host = 'h'}, node_id = 'a', shm = 'cluster', x = 1}",
     "opts.x is not an option"),
    ("{redis = {host = 'h', port = 0}, node_id = 'a', shm = 'cluster'}",
     "opts.redis.port must be a whole number from 1 to 65535"),
    ("{redis = {host = 'h', sentinels = {{host = 'h'}}, master_name = 'm'},"
     " node_id = 'a', shm = 'cluster'}", "host/port or sentinels"),
    ("{redis = {sentinels = {{host = 'h'}}}, node_id = 'a', shm = 'cluster'}",
     "opts.redis.master_name is required with opts.redis.sentinels"),
    ("{redis = {host = 'h', bogus = 1}, node_id = 'a', shm = 'cluster'}",
     "opts.redis.bogus is not an option"),
    ("{redis = {}, node_id = 'a', shm = 'cluster'}",
     "opts.redis.host or opts.redis.sentinels is required"),
    ("{redis = {host = 'h', connect_timeout = 0/0}, node_id = 'a',"
     " shm = 'cluster'}",
     "opts.redis.connect_timeout must be a number from 0.001 to 60"),
    ("{redis = {sentinels = {{port = 1}}, master_name = 'm'}, node_id = 'a',"
     " shm = 'cluster'}", "opts.redis.sentinels[1].host is required"),
    ("{redis = {sentinels = {{host = 'h', x = 1}}, master_name = 'm'},"
     " node_id = 'a', shm = 'cluster'}",
     "opts.redis.sentinels[1].x is not an option"),
    ("{redis = {sentinels = {{host = 'h'}, n = 1}, master_name = 'm'},"
     " node_id = 'a', shm = 'cluster'}",
     "opts.redis.sentinels must be a list of 1 to 64"),
    ("{redis = {host = 'h'}, shm = 'cluster'}", "opts.node_id is required"),
    ("{redis = {host = 'h'}, node_id = 'a b', shm = 'cluster'}",
     "opts.node_id must be a string of 1 to 200 bytes without spaces"),
    ("{redis = {host = 'h'}, node_id = 'a', shm = 'nope'}",
     "opts.shm must be the name of a lua_shared_dict"),
    ("{redis = {host = 'h'}, node_id = 'a', shm = 'cluster', batch = 0/0}",
     "opts.batch must be a whole number from 1 to 10000"),
    ("{redis = {host = 'h'}, node_id = 'a', shm = 'cluster',"
     " block = math.huge}", "opts.block must be a number from 0.01 to 60"),
    ("{redis = {host = 'h'}, node_id = 'a', shm = 'cluster', maxlen = 1.5}",
     "opts.maxlen must be a whole number from 1000 to 1000000000000"),
    ("{redis = {host = 'h'}, node_id = 'a', shm = 'cluster',"
     " when_down = 'drop'}", 'opts.when_down must be "reject" or "queue"'),
    ("{redis = {host = 'h'}, node_id = 'a', shm = 'cluster',"
     " claim_idle = 100, group_idle = 50}",
     "opts.claim_idle must be less than opts.group_idle"),
    ("{redis = {host = 'h'}, node_id = 'a', shm = 'cluster',"
     " backoff_min = 2, backoff_max = 1}",
     "opts.backoff_min must be at most opts.backoff_max"),
    ("{redis = {host = 'h'}, node_id = 'one', shm = 'cluster'}",
     'must not be "one"'),
    ("{redis = {host = 'h'}, node_id = 'a', shm = 'cluster', marks_file = 5}",
     "opts.marks_file must be an absolute path"),
    ("{redis = {host = 'h'}, node_id = 'a', shm = 'cluster',"
     " marks_file = 'rel/x'}", "opts.marks_file must be an absolute path"),
    ("{redis = {host = 'h'}, node_id = 'a', shm = 'cluster'}",
     "opts.marks_file is required when no resty.loom.events bus"),
    ("{redis = {host = 'h'}, node_id = 'a', shm = 'cluster',"
     " marks_file = '/nonexistent/loom/x.marks'}",
     "opts.marks_file: failed to open /nonexistent/loom/x.marks: "
     "No such file or directory"),
]


def test_bad_options_are_refused_with_the_option_named(nginx):
    cases = "\n".join(
        "do local ok, err = pcall(function() cluster.new(%s) end); "
        "ngx.say(ok and 'accepted' or err) end" % lua for lua, _ in BAD)
    n = nginx(http="lua_shared_dict cluster 1m;", server="""
        location /t { content_by_lua_block {
            local cluster = require "resty.loom.cluster"
            %s
            local timer = require "resty.loom.timer"
            for _, o in ipairs({
                { interval = 1, unique = "node", name = "x" },
                { interval = 1, unique = "cluster" },
                { interval = 0, unique = "cluster", name = "x" },
                { interval = 1, unique = "cluster", name = "x", ttl = -1 },
                { interval = 1, unique = "cluster", name = "x", y = 1 },
                { interval = 1, unique = "cluster", name = "x" },
                { interval = 1, unique = "cluster", name = "x",
                  max_run_time = 0 },
            }) do
                local ok, err = pcall(function()
                    timer.every(o, function() end)
                end)
                ngx.say(ok and "accepted" or err)
            end
        } }""" % cases)
    lines = n.get("/t").text.splitlines()
    for (lua, want), got in zip(BAD, lines):
        assert want in got, (lua, got)
        # the error points at the caller, not at the module
        assert got.startswith("content_by_lua"), got
    timer_lines = lines[len(BAD):]
    assert len(timer_lines) == 7, timer_lines
    for got in timer_lines:
        assert got.startswith("content_by_lua"), got
    assert 'opts.unique must be "cluster"' in timer_lines[0]
    assert "opts.name is required" in timer_lines[1]
    assert "opts.interval must be a number from 0.01 to 31622400" \
        in timer_lines[2]
    assert "opts.ttl must be a number from 0.1 to 3600" in timer_lines[3]
    assert "opts.y is not an option" in timer_lines[4]
    # a well-formed cluster timer needs a cluster: none was made here
    assert "opts.cluster is required when no resty.loom.cluster was " \
        "made yet" in timer_lines[5]
    assert "opts.max_run_time must be a number above 0 and at most " \
        "1000000000" in timer_lines[6]


def janitor_node(nginx, r):
    """a node that removes groups silent for 5 s, once it removed one"""
    n = start_node(nginx, {"host": "127.0.0.1", "port": r.port}, "a",
                   group_idle=5, claim_idle=1, ack_timeout=0.5)
    wait_readers([n])
    deadline = time.time() + 10
    while stats(n)["groups_removed"] < 1 and time.time() < deadline:
        time.sleep(0.1)
    return n


@need_redis
def test_groups_of_nodes_that_left_are_removed(redis_factory, nginx):
    r = redis_factory()
    r.cli("XGROUP", "CREATE", "loom:cluster", "gone", "$", "MKSTREAM")
    r.cli("XGROUP", "CREATE", "loom:cluster", "fresh", "$")
    now_ms = int(time.time() * 1000)
    r.cli("HSET", "loom:cluster:nodes", "gone", str(now_ms - 10000),
          "fresh", str(now_ms))
    n = janitor_node(nginx, r)
    groups = r.cli("XINFO", "GROUPS", "loom:cluster")
    assert stats(n)["groups_removed"] == 1
    assert "gone" not in groups and "fresh" in groups and "\na\n" in groups
    assert "gone" in r.cli("HKEYS", "loom:cluster:removed")
    n.wait_log(r"removed the group of node gone")


@need_redis
def test_marks_of_removed_groups_are_kept_group_idle_only(redis_factory,
                                                          nginx):
    """<stream>:removed holds the nodes whose group went, for group_idle:
    nodes that never come back do not pile up there"""
    r = redis_factory()
    now_ms = int(time.time() * 1000)
    old = []
    for i in range(1000):      # removed 20 s ago (group_idle is 5 s)
        old += ["old%d" % i, str(now_ms - 20000)]
    r.cli("HSET", "loom:cluster:removed", *old)
    r.cli("HSET", "loom:cluster:removed", "recent", str(now_ms))
    r.cli("XGROUP", "CREATE", "loom:cluster", "gone", "$", "MKSTREAM")
    r.cli("HSET", "loom:cluster:nodes", "gone", str(now_ms - 10000))
    n = janitor_node(nginx, r)
    time.sleep(0.6)     # a janitor round (every claim_idle / 2)
    left = sorted(r.cli("HKEYS", "loom:cluster:removed").split())
    assert left == ["gone", "recent"]
    # and those two go once they are group_idle old
    deadline = time.time() + 15
    while r.cli("HLEN", "loom:cluster:removed").strip() != "0":
        assert time.time() < deadline, \
            r.cli("HGETALL", "loom:cluster:removed")
        time.sleep(0.2)


@need_redis
def test_one_entries_of_a_dead_node_are_claimed(redis_factory, nginx):
    r = redis_factory()
    r.cli("XGROUP", "CREATE", "loom:cluster:one", "one", "0", "MKSTREAM")
    # an entry the dead node "d" read and never acknowledged
    n = start_node(nginx, {"host": "127.0.0.1", "port": r.port}, "a",
                   claim_idle=1, ack_timeout=0.5)
    wait_readers([n])
    assert n.get("/cl/plant?tag=c&seq=1").text == "taken by d\n"
    deadline = time.time() + 15
    while time.time() < deadline:
        total = sum(c[("c", 1)] for c in handled(n).values())
        if total:
            break
        time.sleep(0.1)
    time.sleep(1)
    total = sum(c[("c", 1)] for c in handled(n).values())
    assert total == 1, handled(n)
    assert stats(n)["claimed"] == 1
    pending = r.cli("XPENDING", "loom:cluster:one", "one").split("\n")[0]
    assert pending == "0"


@need_redis
def test_a_redis_with_a_password(redis_factory, nginx):
    """requirepass: the cluster authenticates; and a pooled connection
    authenticated with one password is never handed to a conf with
    another (it would skip AUTH)"""
    r = redis_factory()
    r.cli("CONFIG", "SET", "requirepass", "s3cret")
    node = start_node(nginx, {"host": "127.0.0.1", "port": r.port,
                              "password": "s3cret"}, "p")
    wait_readers([node])
    assert publish(node, 100, "p")["ok"] == 100
    res, lost, dups = wait_tally([node], {("p", s) for s in range(1, 101)})
    assert (lost, dups) == (0, 0), res

    n = nginx(workers=1, server="""
        location /t { content_by_lua_block {
            local rconn = require "resty.loom.cluster.redis"
            local function conf(pw)
                return rconn.check({ host = "127.0.0.1", port = %d,
                                     password = pw }, 1)
            end
            local red = assert(rconn.connect(conf("s3cret"), 1))
            assert(red:ping())
            assert(red:set_keepalive(10000, 4))
            local other, err = rconn.connect(conf("wrong"), 1)
            ngx.say(other and "connected" or err)
        } }""" % r.port)
    got = n.get("/t").text
    assert got.startswith("auth: WRONGPASS"), got
