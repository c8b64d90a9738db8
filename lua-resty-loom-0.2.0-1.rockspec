-- LuaRocks: the Lua modules of resty-loom and the nginx module they need.
-- The build step is `make build`: it compiles ngx_loom_module.so against
-- the nginx source tree in NGINX_SRC (Debian's nginx-dev,
-- /usr/share/nginx/src, by default), so the nginx that loads it must be
-- that nginx (it also builds the benchmarks' Pub/Sub sink, which the rock
-- does not install). LuaRocks then installs the Lua modules into its
-- LUADIR and ngx_loom_module.so into the rock's LIBDIR (e.g.
-- ~/.luarocks/lib/lua/5.1/ngx_loom_module.so with --local): give that
-- path to nginx's load_module. It is an nginx module, not a Lua C module:
-- require() cannot load it.
rockspec_format = "3.0"
package = "lua-resty-loom"
version = "0.2.0-1"
source = {
   url = "git+https://github.com/resty-loom/lua-resty-loom.git",
   tag = "v0.2.0",
}
description = {
   summary = "Inter-worker events, a timing wheel, native offload, an "
             .. "event-loop watchdog and batched Pub/Sub publishing for "
             .. "nginx + LuaJIT",
   detailed = [[
resty.loom.events (an acknowledged inter-worker event bus with
lua-resty-events and lua-resty-worker-events compatible APIs),
resty.loom.timer (a timing wheel on reused runners), resty.loom.offload
(native calls on threads), resty.loom.watchdog (finds code blocking the
event loop), resty.loom.publish (batched Google Cloud Pub/Sub publishing).
Needs lua-nginx-module and lua-resty-core; the rock builds the
ngx_loom_module nginx module (load_module it from the rock's lib dir).]],
   homepage = "https://github.com/resty-loom/lua-resty-loom",
   license = "BSD-2-Clause",
}
dependencies = {
   "lua == 5.1",
}
build = {
   type = "make",
   build_target = "build",
   -- LuaRocks installs the files itself, from the lists below, so that
   -- its manifest names every module (`make install` is for /usr/local)
   install_pass = false,
   install = {
      lib = { ngx_loom_module = "build/ngx_loom_module.so" },
      lua = {
         ["resty.loom.at_close"] = "lib/resty/loom/at_close.lua",
         ["resty.loom.cluster"] = "lib/resty/loom/cluster.lua",
         ["resty.loom.cluster.janitor"] = "lib/resty/loom/cluster/janitor.lua",
         ["resty.loom.cluster.marks"] = "lib/resty/loom/cluster/marks.lua",
         ["resty.loom.cluster.reader"] = "lib/resty/loom/cluster/reader.lua",
         ["resty.loom.cluster.receiver"] = "lib/resty/loom/cluster/receiver.lua",
         ["resty.loom.cluster.redis"] = "lib/resty/loom/cluster/redis.lua",
         ["resty.loom.cluster.resp"] = "lib/resty/loom/cluster/resp.lua",
         ["resty.loom.cluster.sender"] = "lib/resty/loom/cluster/sender.lua",
         ["resty.loom.cluster.stats"] = "lib/resty/loom/cluster/stats.lua",
         ["resty.loom.cluster.timer"] = "lib/resty/loom/cluster/timer.lua",
         ["resty.loom.compat.common"] = "lib/resty/loom/compat/common.lua",
         ["resty.loom.compat.disable_listening"] = "lib/resty/loom/compat/disable_listening.lua",
         ["resty.loom.compat.events"] = "lib/resty/loom/compat/events.lua",
         ["resty.loom.compat.events_compat"] = "lib/resty/loom/compat/events_compat.lua",
         ["resty.loom.compat.worker_events"] = "lib/resty/loom/compat/worker_events.lua",
         ["resty.loom.crc32c"] = "lib/resty/loom/crc32c.lua",
         ["resty.loom.error_handler"] = "lib/resty/loom/error_handler.lua",
         ["resty.loom.events"] = "lib/resty/loom/events.lua",
         ["resty.loom.events.broker"] = "lib/resty/loom/events/broker.lua",
         ["resty.loom.events.broker_acks"] = "lib/resty/loom/events/broker_acks.lua",
         ["resty.loom.events.broker_lane"] = "lib/resty/loom/events/broker_lane.lua",
         ["resty.loom.events.broker_queue"] = "lib/resty/loom/events/broker_queue.lua",
         ["resty.loom.events.broker_reader"] = "lib/resty/loom/events/broker_reader.lua",
         ["resty.loom.events.broker_route"] = "lib/resty/loom/events/broker_route.lua",
         ["resty.loom.events.broker_stats"] = "lib/resty/loom/events/broker_stats.lua",
         ["resty.loom.events.broker_writer"] = "lib/resty/loom/events/broker_writer.lua",
         ["resty.loom.events.client"] = "lib/resty/loom/events/client.lua",
         ["resty.loom.events.collect"] = "lib/resty/loom/events/collect.lua",
         ["resty.loom.events.dispatch"] = "lib/resty/loom/events/dispatch.lua",
         ["resty.loom.events.exit"] = "lib/resty/loom/events/exit.lua",
         ["resty.loom.events.fifo"] = "lib/resty/loom/events/fifo.lua",
         ["resty.loom.events.frame"] = "lib/resty/loom/events/frame.lua",
         ["resty.loom.events.handshake"] = "lib/resty/loom/events/handshake.lua",
         ["resty.loom.events.lane"] = "lib/resty/loom/events/lane.lua",
         ["resty.loom.events.log"] = "lib/resty/loom/events/log.lua",
         ["resty.loom.events.own"] = "lib/resty/loom/events/own.lua",
         ["resty.loom.events.receive"] = "lib/resty/loom/events/receive.lua",
         ["resty.loom.events.ring"] = "lib/resty/loom/events/ring.lua",
         ["resty.loom.events.shm"] = "lib/resty/loom/events/shm.lua",
         ["resty.loom.file"] = "lib/resty/loom/file.lua",
         ["resty.loom.flamegraph"] = "lib/resty/loom/flamegraph.lua",
         ["resty.loom.histogram"] = "lib/resty/loom/histogram.lua",
         ["resty.loom.http"] = "lib/resty/loom/http.lua",
         ["resty.loom.jwt"] = "lib/resty/loom/jwt.lua",
         ["resty.loom.offload"] = "lib/resty/loom/offload.lua",
         ["resty.loom.opts"] = "lib/resty/loom/opts.lua",
         ["resty.loom.publish"] = "lib/resty/loom/publish.lua",
         ["resty.loom.publish.auth"] = "lib/resty/loom/publish/auth.lua",
         ["resty.loom.publish.base64"] = "lib/resty/loom/publish/base64.lua",
         ["resty.loom.publish.buffer"] = "lib/resty/loom/publish/buffer.lua",
         ["resty.loom.publish.json"] = "lib/resty/loom/publish/json.lua",
         ["resty.loom.publish.report"] = "lib/resty/loom/publish/report.lua",
         ["resty.loom.publish.sender"] = "lib/resty/loom/publish/sender.lua",
         ["resty.loom.publish.shutdown"] = "lib/resty/loom/publish/shutdown.lua",
         ["resty.loom.publish.spool"] = "lib/resty/loom/publish/spool.lua",
         ["resty.loom.publish.spoolfile"] = "lib/resty/loom/publish/spoolfile.lua",
         ["resty.loom.publish.stats"] = "lib/resty/loom/publish/stats.lua",
         ["resty.loom.status"] = "lib/resty/loom/status.lua",
         ["resty.loom.status.dashboard"] = "lib/resty/loom/status/dashboard.lua",
         ["resty.loom.status.hist"] = "lib/resty/loom/status/hist.lua",
         ["resty.loom.status.prometheus"] = "lib/resty/loom/status/prometheus.lua",
         ["resty.loom.timer"] = "lib/resty/loom/timer.lua",
         ["resty.loom.timer.array"] = "lib/resty/loom/timer/array.lua",
         ["resty.loom.timer.control"] = "lib/resty/loom/timer/control.lua",
         ["resty.loom.timer.core"] = "lib/resty/loom/timer/core.lua",
         ["resty.loom.timer.create"] = "lib/resty/loom/timer/create.lua",
         ["resty.loom.timer.jobs"] = "lib/resty/loom/timer/jobs.lua",
         ["resty.loom.timer.run"] = "lib/resty/loom/timer/run.lua",
         ["resty.loom.timer.schedule"] = "lib/resty/loom/timer/schedule.lua",
         ["resty.loom.timer.sites"] = "lib/resty/loom/timer/sites.lua",
         ["resty.loom.timer.stats"] = "lib/resty/loom/timer/stats.lua",
         ["resty.loom.timer.wheel"] = "lib/resty/loom/timer/wheel.lua",
         ["resty.loom.watchdog"] = "lib/resty/loom/watchdog.lua",
         ["resty.loom.watchdog.cdef"] = "lib/resty/loom/watchdog/cdef.lua",
         ["resty.loom.watchdog.log"] = "lib/resty/loom/watchdog/log.lua",
         ["resty.loom.watchdog.names"] = "lib/resty/loom/watchdog/names.lua",
         ["resty.loom.watchdog.report"] = "lib/resty/loom/watchdog/report.lua",
         ["resty.loom.watchdog.stack"] = "lib/resty/loom/watchdog/stack.lua",
         ["resty.loom.watchdog.timers"] = "lib/resty/loom/watchdog/timers.lua",
         ["resty.loom.yield"] = "lib/resty/loom/yield.lua",
      },
   },
   copy_directories = { "docs" },
}
