-- The bus's wire format. Every frame has a 16-byte header (sequence
-- number, low half first; version, type, flags, payload length), the
-- payload and an 8-byte trailer (the sequence's low half again and the
-- part number of a chunked payload). Events carry a 40-byte event header
-- (target, publisher, pid, incarnation, stream sequence, publish time,
-- lengths) followed by the unique key and the string.buffer-encoded body.
-- Payloads larger than one chunk travel as several EVENT frames with the
-- MORE flag.
--
-- Frames are built in and parsed from string.buffer memory through FFI, so
-- payload bytes become Lua strings only where cosockets need them: whole
-- batches sent, and what a read returns. OpenResty's LuaJIT hashes strings
-- of 128 bytes or more from a sample (their length, 16 words at places
-- fixed per process, the first and the last 8 bytes), so near-identical
-- strings of one length collide in the string table and interning them
-- turns quadratic. Frames therefore start and end with bytes no other
-- frame has, writes are runs of whole frames, and readers ask for exactly
-- the rest of a frame once they have its header and more than a little is
-- missing (peek() says how much), so what they read of large frames starts
-- at a header or ends at a trailer.


local ffi = require "ffi"
local buffer = require "string.buffer"
local tab_clone = require "table.clone"

local ffi_cast = ffi.cast
local ffi_sizeof = ffi.sizeof
local buf_new = buffer.new
local floor = math.floor
local pairs = pairs
local type = type


ffi.cdef [[
typedef struct {
    uint32_t  seq_lo;
    uint8_t   version;
    uint8_t   type;
    uint16_t  flags;
    uint32_t  len;
    uint32_t  seq_hi;
} loom_ev_frame_t;

typedef struct {
    int16_t   target;
    int16_t   publisher;
    uint32_t  pid;
    double    stream_seq;
    double    published_at;
    uint32_t  key_len;
    uint32_t  body_len;
    uint32_t  incarnation;
    uint32_t  reserved;
} loom_ev_event_t;

typedef struct {
    uint32_t  seq_lo;
    uint32_t  part;
} loom_ev_trailer_t;

typedef struct {
    int16_t   publisher;
    uint16_t  reserved;
    uint32_t  events;
    double    pos;
    uint32_t  len;
    uint32_t  reserved2;
} loom_ev_shm_t;
]]


local FRAME_PTR = ffi.typeof("loom_ev_frame_t *")
local EVENT_PTR = ffi.typeof("loom_ev_event_t *")
local FRAME_SIZE = ffi_sizeof("loom_ev_frame_t")
local EVENT_SIZE = ffi_sizeof("loom_ev_event_t")
local TRAILER_PTR = ffi.typeof("loom_ev_trailer_t *")
local TRAILER_SIZE = ffi_sizeof("loom_ev_trailer_t")
local SHM_PTR = ffi.typeof("loom_ev_shm_t *")
local SHM_SIZE = ffi_sizeof("loom_ev_shm_t")

local VERSION = 1
local CHUNK = 256 * 1024
local FLAG_MORE = 1
local KEY_MAX = 1024       -- longest unique key

-- how the clients and the broker read and write the socket:
local READ_SIZE = 65536
local YIELD_BYTES = 65536  -- read between yields to the event loop
-- bytes per write: LuaJIT allocates strings over 128 KiB with mmap, which
-- page-faults them in on every write
local WRITE_MAX = 65536
-- a frame still missing more than this is read exactly to its end; below
-- it, the next read takes whatever is there (one call instead of two,
-- and runs of small frames differ often enough where LuaJIT samples)
local EXACT_MIN = 1024

local T_HELLO = 1
local T_WELCOME = 2
local T_EVENT = 3
local T_ACK = 4
local T_PING = 5
local T_PONG = 6
local T_REJECT = 7
local T_BYE = 8
-- an event of the bus's own (collect): one frame, no sequence number, no
-- acknowledgement; sent ahead of queued events and handled on arrival
local T_URGENT = 9
-- the broker's answer to a unique event that lands on its own publisher
-- (header only, the event's sequence number): run the publisher's copy,
-- or skip it (suppressed); the event itself does not come back
local T_OWN_RUN = 10
local T_OWN_SKIP = 11
-- a run of events to "all" or "others" in the publisher's ring (see
-- shm.lua): its sequence number is the run's last event's
local T_SHM = 12
local T_MAX = 12

-- reused scratch buffer for event bodies (the worker is single-threaded)
local body = buf_new(4096)


local _M = {
    _VERSION = "0.2.0",
    VERSION = VERSION,
    FRAME_SIZE = FRAME_SIZE,
    TRAILER_SIZE = TRAILER_SIZE,
    EVENT_SIZE = EVENT_SIZE,
    CHUNK = CHUNK,
    FLAG_MORE = FLAG_MORE,
    KEY_MAX = KEY_MAX,
    READ_SIZE = READ_SIZE,
    YIELD_BYTES = YIELD_BYTES,
    WRITE_MAX = WRITE_MAX,
    EXACT_MIN = EXACT_MIN,
    HELLO = T_HELLO,
    WELCOME = T_WELCOME,
    EVENT = T_EVENT,
    ACK = T_ACK,
    PING = T_PING,
    PONG = T_PONG,
    REJECT = T_REJECT,
    BYE = T_BYE,
    URGENT = T_URGENT,
    OWN_RUN = T_OWN_RUN,
    OWN_SKIP = T_OWN_SKIP,
    SHM = T_SHM,
    -- targets other than a worker id (>= 0); -1 is the privileged agent
    AGENT = -1,
    ALL = -2,
    OTHERS = -3,
    UNIQUE = -4,
}


local function put_header(buf, typ, flags, len, seq)
    local h = ffi_cast(FRAME_PTR, buf:reserve(FRAME_SIZE))
    h.seq_lo = seq % 4294967296
    h.version = VERSION
    h.type = typ
    h.flags = flags
    h.len = len
    h.seq_hi = floor(seq / 4294967296)
    buf:commit(FRAME_SIZE)
end
_M.put_header = put_header


local function put_trailer(buf, seq, part)
    local t = ffi_cast(TRAILER_PTR, buf:reserve(TRAILER_SIZE))
    t.seq_lo = seq % 4294967296
    t.part = part
    buf:commit(TRAILER_SIZE)
end
_M.put_trailer = put_trailer


-- a frame without payload (ack, ping, pong, bye)
function _M.put_empty(buf, typ, seq)
    put_header(buf, typ, 0, 0, seq)
    put_trailer(buf, seq, 0)
end


-- a control frame whose payload is a string.buffer-encoded Lua value
function _M.put_control(buf, typ, seq, value)
    body:reset()
    if value ~= nil then
        body:encode(value)
    end
    local p, len = body:ref()
    put_header(buf, typ, 0, len, seq)
    buf:putcdata(p, len)
    put_trailer(buf, seq, 0)
end


-- Encodes the event body into the scratch buffer and returns its length;
-- put_event() then writes it. Split so that callers can check the size
-- (and their queue bounds) before anything is queued.
function _M.encode_body(source, event, data)
    body:reset()
    body:encode(source)
    body:encode(event)
    body:encode(data)
    return #body
end


-- Appends frames carrying one payload to buf: a single frame, or CHUNK-
-- sized frames with the MORE flag on all but the last.
local function put_chunked(buf, typ, seq, p, len)
    if len <= CHUNK then
        put_header(buf, typ, 0, len, seq)
        buf:putcdata(p, len)
        put_trailer(buf, seq, 0)
        return
    end
    local off, part = 0, 0
    while off < len do
        local n = len - off
        local fl = 0
        if n > CHUNK then
            n = CHUNK
            fl = FLAG_MORE
        end
        put_header(buf, typ, fl, n, seq)
        buf:putcdata(p + off, n)
        put_trailer(buf, seq, part)
        off = off + n
        part = part + 1
    end
end
_M.put_chunked = put_chunked


local payload = buf_new(4096)     -- a chunked event, before its frames

-- the event payload (event header, unique key, the body encode_body()
-- produced) appended to buf
local function put_payload(buf, target, publisher, pid, incarnation,
                           stream_seq, now, key, key_len, bp, body_len)
    local e = ffi_cast(EVENT_PTR, buf:reserve(EVENT_SIZE))
    e.target = target
    e.publisher = publisher
    e.pid = pid
    e.incarnation = incarnation
    e.reserved = 0
    e.stream_seq = stream_seq
    e.published_at = now
    e.key_len = key_len
    e.body_len = body_len
    buf:commit(EVENT_SIZE)
    if key_len > 0 then
        buf:put(key)
    end
    buf:putcdata(bp, body_len)
end

-- Appends an event (whose body encode_body() just produced) to buf;
-- returns the number of bytes appended.
function _M.put_event(buf, seq, target, publisher, pid, incarnation,
                      stream_seq, now, key)
    local key_len = key and #key or 0
    local bp, body_len = body:ref()
    local len = EVENT_SIZE + key_len + body_len

    if len <= CHUNK then
        -- one frame, written in place: no intermediate copy
        put_header(buf, T_EVENT, 0, len, seq)
        put_payload(buf, target, publisher, pid, incarnation, stream_seq,
                    now, key, key_len, bp, body_len)
        put_trailer(buf, seq, 0)
        return FRAME_SIZE + len + TRAILER_SIZE
    end

    payload:reset()
    put_payload(payload, target, publisher, pid, incarnation, stream_seq,
                now, key, key_len, bp, body_len)
    local before = #buf
    local p, plen = payload:ref()
    put_chunked(buf, T_EVENT, seq, p, plen)
    return #buf - before
end


-- Appends an SHM frame: the run of n events (seq its last) that worker
-- publisher wrote at pos of its ring (len bytes).
function _M.put_shm(buf, seq, publisher, n, pos, len)
    put_header(buf, T_SHM, 0, SHM_SIZE, seq)
    local s = ffi_cast(SHM_PTR, buf:reserve(SHM_SIZE))
    s.publisher = publisher
    s.reserved = 0
    s.events = n
    s.pos = pos
    s.len = len
    s.reserved2 = 0
    buf:commit(SHM_SIZE)
    put_trailer(buf, seq, 0)
    return FRAME_SIZE + SHM_SIZE + TRAILER_SIZE
end


-- The SHM frame's payload (pp, len bytes), or nil when it is not one.
function _M.check_shm(pp, len)
    if len ~= SHM_SIZE then
        return nil
    end
    return ffi_cast(SHM_PTR, pp)
end


-- Appends an urgent event (whose body encode_body() just produced, at most
-- CHUNK bytes with its event header) to buf.
function _M.put_urgent(buf, target, publisher, pid, incarnation)
    local bp, body_len = body:ref()
    put_header(buf, T_URGENT, 0, EVENT_SIZE + body_len, 0)
    put_payload(buf, target, publisher, pid, incarnation, 0, 0, nil, 0, bp,
                body_len)
    put_trailer(buf, 0, 0)
end


-- Looks at the frame at p (n bytes there; peek: at the front of buf).
-- Returns nil and the number of bytes still missing when it is not
-- complete yet (0 for none); false, reason when the bytes are not a valid
-- frame; otherwise the header pointer, the payload pointer and the frame's
-- size (trailer included).
local function peek_at(p, n, max_len)
    if n < FRAME_SIZE then
        return nil, n == 0 and 0 or FRAME_SIZE - n
    end
    local h = ffi_cast(FRAME_PTR, p)
    if h.version ~= VERSION then
        return false, "bad version"
    end
    if h.type == 0 or h.type > T_MAX then
        return false, "bad type"
    end
    if h.flags > FLAG_MORE then
        return false, "bad flags"
    end
    local len = h.len
    if len > max_len then
        return false, "frame too large"
    end
    local size = FRAME_SIZE + len + TRAILER_SIZE
    if n < size then
        return nil, size - n
    end
    if ffi_cast(TRAILER_PTR, p + FRAME_SIZE + len).seq_lo ~= h.seq_lo then
        return false, "bad trailer"
    end
    return h, p + FRAME_SIZE, size
end
_M.peek_at = peek_at


function _M.peek(buf, max_len)
    local p, n = buf:ref()
    return peek_at(p, n, max_len)
end


-- Whether the frame at h (payload pp) carries a whole event: neither
-- followed by more chunks nor a later chunk of one.
function _M.whole(h, pp)
    return h.flags ~= FLAG_MORE
           and ffi_cast(TRAILER_PTR, pp + h.len).part == 0
end


-- Of the n bytes of frames at p (a queue of frames built here): the
-- length of the longest run of whole frames that fits in max bytes, or of
-- the first frame when that alone is larger (a write that starts at a
-- header and ends at a trailer); how many events that run completes; and
-- whether it ends inside a chunked event (its last frame has FLAG_MORE).
function _M.whole_frames(p, n, max)
    local off, events, open = 0, 0, false
    while off + FRAME_SIZE <= n do
        local h = ffi_cast(FRAME_PTR, p + off)
        local size = FRAME_SIZE + h.len + TRAILER_SIZE
        if off > 0 and off + size > max then
            break
        end
        off = off + size
        open = h.flags == FLAG_MORE
        if not open then
            events = events + (h.type == T_SHM
                               and ffi_cast(SHM_PTR, h + 1).events or 1)
        end
    end
    return off, events, open
end


-- Of the n bytes of frames at p (a queue of frames built here): how many
-- events start there, only those of worker `publisher` when given.
function _M.count_events(p, n, publisher)
    local off, events = 0, 0
    while off + FRAME_SIZE <= n do
        local h = ffi_cast(FRAME_PTR, p + off)
        local pp = p + off + FRAME_SIZE
        local typ = h.type
        if typ == T_EVENT and ffi_cast(TRAILER_PTR, pp + h.len).part == 0
           and (not publisher
                or ffi_cast(EVENT_PTR, pp).publisher == publisher) then
            events = events + 1
        elseif typ == T_SHM and (not publisher
               or ffi_cast(SHM_PTR, pp).publisher == publisher) then
            events = events + ffi_cast(SHM_PTR, pp).events
        end
        off = off + FRAME_SIZE + h.len + TRAILER_SIZE
    end
    return events
end


-- A pointer to a string's bytes, and its length (valid while the string
-- is referenced).
function _M.ptr(str)
    return ffi_cast("const uint8_t *", str), #str
end


-- The frame at p (built here, so trusted): header, payload, size.
function _M.at(p)
    local h = ffi_cast(FRAME_PTR, p)
    return h, p + FRAME_SIZE, FRAME_SIZE + h.len + TRAILER_SIZE
end


function _M.seq(h)
    return h.seq_hi * 4294967296 + h.seq_lo
end


-- The payload of the event that the frame at h (payload pp) carries or
-- completes: pointer and length. An event in one frame comes at once; a
-- chunked one (FLAG_MORE on all but its last frame, trailers numbering the
-- parts from 0) is collected in st.partial and comes with its last frame
-- (the caller drops st.partial when done with it). Returns nil while
-- frames are missing, or false and what was wrong.
function _M.collect(st, seq, h, pp, max_payload)
    local partial = st.partial
    local plen = h.len
    local part = ffi_cast(TRAILER_PTR, pp + plen).part
    if not partial then
        if part ~= 0 then
            -- the tail of an event whose start never came
            return false, "chunk out of order"
        end
        if h.flags ~= FLAG_MORE then
            return pp, plen
        end
        if plen < EVENT_SIZE then
            return false, "short event"
        end
        partial = buf_new(2 * CHUNK)
        st.partial, st.partial_seq = partial, seq
    elseif seq ~= st.partial_seq then
        return false, "interleaved chunks"
    elseif part ~= st.partial_part + 1 then
        return false, "chunk out of order"
    end
    st.partial_part = part
    partial:putcdata(pp, plen)
    if #partial > max_payload + EVENT_SIZE + KEY_MAX then
        return false, "event too large"
    end
    if h.flags == FLAG_MORE then
        return nil
    end
    return partial:ref()
end


-- The event header of a complete event payload, or nil and a reason when
-- its lengths do not add up (never trust a peer's lengths).
function _M.check_event(p, len)
    if len < EVENT_SIZE then
        return nil, "short event"
    end
    local e = ffi_cast(EVENT_PTR, p)
    local key_len = e.key_len
    if key_len > KEY_MAX then
        return nil, "unique key too long"
    end
    if EVENT_SIZE + key_len + e.body_len ~= len then
        return nil, "bad event lengths"
    end
    return e
end


-- Decodes a control payload (or nil for an empty one). Errors on garbage;
-- callers use pcall.
local dec = buf_new()
function _M.decode_control(p, len)
    if len == 0 then
        return nil
    end
    dec:set(p, len)
    local v = dec:decode()
    if #dec ~= 0 then
        error("trailing bytes")
    end
    return v
end


-- Decodes an event body: source, event, data. Errors on garbage.
function _M.decode_body(p, len)
    dec:set(p, len)
    local source = dec:decode()
    local event = dec:decode()
    local data = dec:decode()
    if #dec ~= 0 or type(source) ~= "string" or type(event) ~= "string" then
        error("malformed event body")
    end
    return source, event, data
end


-- A copy of data as decoding what encode_body() made of it would give
-- (for data it accepted): tables are copied and lose their metatables;
-- strings, numbers and the rest are immutable and shared. What a worker
-- hands its own handlers for its own events; cheaper than the codec.
local function copy_data(v)
    if type(v) ~= "table" then
        return v
    end
    local t = tab_clone(v)
    local table_keys = false
    for k, x in pairs(t) do
        if type(x) == "table" then
            t[k] = copy_data(x)
        end
        if type(k) == "table" then
            table_keys = true
        end
    end
    if table_keys then
        -- keys cannot be replaced while iterating: copy them into a new one
        local u = {}
        for k, x in pairs(t) do
            u[copy_data(k)] = x
        end
        return u
    end
    return t
end

_M.copy_data = copy_data

return _M
