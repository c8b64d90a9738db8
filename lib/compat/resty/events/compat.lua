-- `require "resty.events.compat"` (see lib/compat/resty/events.lua)
return require "resty.loom.compat.events_compat"
