-- `require "resty.worker.events"` for code written for
-- lua-resty-worker-events: put lib/compat/ first on lua_package_path (see
-- docs/events.md).
return require "resty.loom.compat.worker_events"
