-- The janitor, run by each node's reader: the node's heartbeat in
-- <stream>:nodes, and the removal of the groups of nodes silent for
-- group_idle (and of the old marks of removed ones in <stream>:removed).


local stats = require "resty.loom.cluster.stats"

local ngx_log = ngx.log
local ngx_NOTICE = ngx.NOTICE
local floor = math.floor
local type = type
local tonumber = tonumber
local count = stats.count

local LOG_TAG = "[loom.cluster] "


local _M = { _VERSION = "0.2.0" }


local function redis_ms(red)
    local t, err = red:time()
    if type(t) ~= "table" then
        return nil, err
    end
    return tonumber(t[1]) * 1000 + floor(tonumber(t[2]) / 1000)
end


-- heartbeat in <stream>:nodes (Redis's clock), removal of the groups of
-- nodes silent for group_idle, and of the marks in <stream>:removed older
-- than group_idle: a node back after that is a new node (it resyncs only
-- if its shared dict remembers the group)
local function maintain(self, red)
    local now, err = redis_ms(red)
    if not now then
        return nil, err
    end
    red:hset(self.nodes_key, self.node_id, now)
    local removed_key = self.stream .. ":removed"
    local marks = red:hgetall(removed_key)
    if type(marks) == "table" then
        for i = 1, #marks - 1, 2 do
            local at = tonumber(marks[i + 1])
            if not at or now - at > self.group_idle * 1000 then
                red:hdel(removed_key, marks[i])
            end
        end
    end
    local all = red:hgetall(self.nodes_key)
    if type(all) ~= "table" then
        return true
    end
    for i = 1, #all - 1, 2 do
        local node, seen = all[i], tonumber(all[i + 1])
        if node ~= self.node_id and seen
           and now - seen > self.group_idle * 1000
        then
            red:xgroup("DESTROY", self.stream, node)
            red:xgroup("DELCONSUMER", self.stream_one, "one", node)
            red:hdel(self.nodes_key, node)
            red:hset(removed_key, node, now)
            count(self, "groups_removed")
            ngx_log(ngx_NOTICE, LOG_TAG, "removed the group of node ", node,
                    ", silent for ", floor((now - seen) / 1000), " s")
        end
    end
    return true
end


_M.maintain = maintain


return _M
