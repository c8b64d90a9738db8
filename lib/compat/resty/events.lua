-- `require "resty.events"` for code written for lua-resty-events: put
-- lib/compat/ first on lua_package_path (see docs/events.md).
return require "resty.loom.compat.events"
