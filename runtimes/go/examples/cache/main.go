// Example runtime: a per-worker cache plus a few operations the tests and
// the benchmark use. Build it with `make` (go build -buildmode=c-shared)
// and load runtimes/go/build/libloom_rt_go_example.so with offload.load().
//
// Configuration (key=value, separated by spaces): "mode=echo" answers
// every call with its payload (the benchmark); otherwise the payload is
// "<op>:<argument>":
//
//	echo:<x>        returns x
//	hash:<x>        FNV-1a 64 of x, 16 hex digits, memoised in the cache
//	put:<k>=<v>     stores v under k, returns "ok"
//	get:<k>         the stored value, or "miss"
//	count:          calls served by this worker's runtime so far
//	sleep:<ms>      sleeps, stops early when the call is cancelled
//	stuck:<ms>      sleeps without looking at cancellation
//	panic:<msg>     panics with msg
//	error:<msg>     returns an error
//	big:<n>         n bytes of "x"
package main

import (
	"bytes"
	"errors"
	"fmt"
	"hash/fnv"
	"strconv"
	"sync"
	"sync/atomic"
	"time"

	"resty-loom/offload"
)

type cache struct {
	echoOnly bool
	calls    atomic.Uint64
	mu       sync.Mutex
	m        map[string][]byte
}

func (c *cache) get(k string) ([]byte, bool) {
	c.mu.Lock()
	defer c.mu.Unlock()
	v, ok := c.m[k]
	return v, ok
}

func (c *cache) put(k string, v []byte) {
	c.mu.Lock()
	c.m[k] = v
	c.mu.Unlock()
}

func sleep(call *offload.Call, ms int, watchCancel bool) []byte {
	deadline := time.Now().Add(time.Duration(ms) * time.Millisecond)
	for {
		left := time.Until(deadline)
		if left <= 0 {
			return []byte("slept")
		}
		if watchCancel && call.Cancelled() {
			return []byte("cancelled")
		}
		if left > 2*time.Millisecond {
			left = 2 * time.Millisecond
		}
		time.Sleep(left)
	}
}

func (c *cache) Handle(call *offload.Call) ([]byte, error) {
	payload := call.Payload()
	n := c.calls.Add(1)
	if c.echoOnly {
		return payload, nil
	}
	op, arg, found := bytes.Cut(payload, []byte(":"))
	if !found {
		return payload, nil
	}
	switch string(op) {
	case "echo":
		return arg, nil
	case "hash":
		key := "hash:" + string(arg)
		if v, ok := c.get(key); ok {
			return v, nil
		}
		h := fnv.New64a()
		h.Write(arg)
		v := []byte(fmt.Sprintf("%016x", h.Sum64()))
		c.put(key, v)
		return v, nil
	case "put":
		k, v, _ := bytes.Cut(arg, []byte("="))
		c.put(string(k), append([]byte(nil), v...))
		return []byte("ok"), nil
	case "get":
		if v, ok := c.get(string(arg)); ok {
			return v, nil
		}
		return []byte("miss"), nil
	case "count":
		return strconv.AppendUint(nil, n, 10), nil
	case "sleep", "stuck":
		ms, err := strconv.Atoi(string(arg))
		if err != nil {
			return nil, err
		}
		return sleep(call, ms, string(op) == "sleep"), nil
	case "panic":
		panic(string(arg))
	case "error":
		return nil, errors.New(string(arg))
	case "big":
		size, err := strconv.Atoi(string(arg))
		if err != nil {
			return nil, err
		}
		return bytes.Repeat([]byte("x"), size), nil
	}
	return payload, nil
}

func newCache(cfg *offload.Config) (offload.Handler, error) {
	c := &cache{m: make(map[string][]byte)}
	switch mode, _ := cfg.Get("mode"); mode {
	case "", "ops":
	case "echo":
		c.echoOnly = true
	default:
		return nil, fmt.Errorf("unknown mode: %s", mode)
	}
	return c, nil
}

func init() {
	offload.Register(newCache)
}

// A c-shared library needs a main package; main itself never runs.
func main() {}
