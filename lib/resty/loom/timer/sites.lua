-- Where timers come from: the statistics record of the place that created
-- a timer (its "site": the caller's line, the stack that led there and the
-- callback's definition) and the records of named timers.


local stats = require "resty.loom.timer.stats"

local pairs = pairs
local str_find = string.find
local str_sub = string.sub
local tbl_concat = table.concat
local getinfo = debug.getinfo
local new_record = stats.new_record

local ok_clear, tbl_clear = pcall(require, "table.clear")
if not ok_clear then
    tbl_clear = function(t)
        for k in pairs(t) do
            t[k] = nil
        end
    end
end


local MAX_STACK = 12
local MAX_CACHED = 4096


-- frames of this library, and of the watchdog's ngx.timer wrapper, are
-- not the creation site
local function is_ours(src)
    return str_find(src, "resty/loom/timer", 1, true) ~= nil
           or str_find(src, "resty/loom/watchdog", 1, true) ~= nil
end


-- a chunk's file path in full ("@path" sources), else its short name
local function path_of(info)
    local src = info.source
    if str_sub(src, 1, 1) == "@" then
        return str_sub(src, 2)
    end
    return info.short_src
end


-- the statistics record of the place that created a timer. Without
-- precise_sites the place is looked up once per callback function (the
-- first creation with it) and cached, which keeps at() JIT-compiled.
local function site_for(self, cb)
    local precise = self.precise_sites
    local rec
    if not precise then
        if cb == self.last_cb then
            return self.last_rec
        end
        rec = self.site_by_cb[cb]
        if rec then
            self.last_cb = cb
            self.last_rec = rec
            return rec
        end
    end
    -- site_for (1) <- add (2, tail-called by at/every) <- caller (3):
    -- self.site_level; frames of our own modules are skipped
    local level = self.site_level
    local info = getinfo(level, "Sl")
    while info and is_ours(info.source) do
        level = level + 1
        info = getinfo(level, "Sl")
    end
    local key = info and (info.short_src .. ":" .. info.currentline) or "?"
    rec = self.sites[key]
    if not rec then
        rec = new_record("site", key)
        local def = getinfo(cb, "S")
        -- "<created at>|<callback defined at>", full paths: what the
        -- watchdog reports when this timer's callback stalls the loop
        rec.watchdog_site = (info and (path_of(info) .. ":"
                                       .. info.currentline) or "?")
                            .. "|" .. path_of(def) .. ":" .. def.linedefined
        local frames = {}
        local n = 0
        while info and n < MAX_STACK do
            if info.what ~= "C" then
                n = n + 1
                frames[n] = info.short_src .. ":" .. info.currentline
            end
            level = level + 1
            info = getinfo(level, "Sl")
        end
        local folded = {}
        for i = n, 1, -1 do
            folded[#folded + 1] = frames[i]
        end
        folded[#folded + 1] = "callback " .. def.short_src .. ":"
                              .. def.linedefined
        rec.stack = tbl_concat(folded, ";")
        self.sites[key] = rec
        local ns = self.nsites + 1
        self.nsites = ns
        self.site_list[ns] = rec
        rec.idx = ns
    end
    if not precise then
        -- a strong cache, emptied when full: a weak-keyed table would make
        -- every GC cycle walk the fresh closures of code that creates one
        -- per timer
        local n = self.ncached + 1
        if n > MAX_CACHED then
            tbl_clear(self.site_by_cb)
            n = 1
        end
        self.ncached = n
        self.site_by_cb[cb] = rec
        self.last_cb = cb
        self.last_rec = rec
    end
    return rec
end


local function name_rec(self, name)
    local rec = self.name_stats[name]
    if not rec and self.nnames < self.max_names then
        rec = new_record("name", name)
        self.name_stats[name] = rec
        self.nnames = self.nnames + 1
    end
    return rec
end


local _M = {
    _VERSION = "0.2.0",
    site_for = site_for,
    name_rec = name_rec,
}


return _M
