-- `require "resty.events.disable_listening"` (see lib/compat/resty/events.lua)
return require "resty.loom.compat.disable_listening"
