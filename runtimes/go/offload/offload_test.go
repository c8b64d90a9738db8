//go:build loomtest

package offload

import (
	"errors"
	"fmt"
	"runtime"
	"strings"
	"sync/atomic"
	"testing"
	"time"
)

type counter struct {
	calls  atomic.Int64
	closed *atomic.Int64
}

func (c *counter) Handle(call *Call) ([]byte, error) {
	n := c.calls.Add(1)
	switch p := string(call.Payload()); p {
	case "panic":
		panic(fmt.Sprintf("boom %d", n))
	case "error":
		return nil, errors.New("bad input")
	case "count":
		return []byte(fmt.Sprint(n)), nil
	case "wait-cancel":
		for i := 0; i < 500; i++ {
			if call.Cancelled() {
				return []byte("saw cancel"), nil
			}
			time.Sleep(2 * time.Millisecond)
		}
		return []byte("no cancel"), nil
	default:
		return append([]byte("echo:"), p...), nil
	}
}

func (c *counter) Close() { c.closed.Add(1) }

func register(closed *atomic.Int64) {
	Register(func(cfg *Config) (Handler, error) {
		return &counter{closed: closed}, nil
	})
}

func TestResultsErrorsPanicsState(t *testing.T) {
	var closed atomic.Int64
	register(&closed)
	m, err := startMock("", 2)
	if err != nil {
		t.Fatal(err)
	}
	reqs := []string{"hello", "", "error", "panic", "count"}
	for i, r := range reqs {
		m.post(i+1, r)
		if got := m.waitDone(i+1, 5*time.Second); got != i+1 {
			t.Fatalf("answered %d of %d", got, i+1)
		}
	}
	check := func(id, status int, rsp string) {
		t.Helper()
		s, r, n := m.result(id)
		if s != status || r != rsp || n != 1 {
			t.Errorf("task %d: got (%d, %q, %d answers), want (%d, %q)",
				id, s, r, n, status, rsp)
		}
	}
	check(1, 0, "echo:hello")
	check(2, 0, "echo:")
	check(3, 1, "bad input")
	_, msg, _ := m.result(4)
	if !strings.HasPrefix(msg, "panic at ") ||
		!strings.Contains(msg, "offload_test.go:") ||
		!strings.HasSuffix(msg, ": boom 4") {
		t.Errorf("panic message %q", msg)
	}
	check(5, 0, "5") // the state survived the panic
	m.close()
	if closed.Load() != 1 {
		t.Errorf("Close called %d times", closed.Load())
	}
}

// Goroutines blocked in host->wait() get Ps of their own on top of the
// ones Go code has, and give them back when the runtime stops.
func TestGomaxprocsCoversServingGoroutines(t *testing.T) {
	var closed atomic.Int64
	register(&closed)
	base := runtime.GOMAXPROCS(0)
	a, err := startMock("", 3)
	if err != nil {
		t.Fatal(err)
	}
	b, err := startMock("", 2)
	if err != nil {
		t.Fatal(err)
	}
	if got := runtime.GOMAXPROCS(0); got != base+5 {
		t.Errorf("GOMAXPROCS %d with 5 serving goroutines, want %d",
			got, base+5)
	}
	a.close()
	if got := runtime.GOMAXPROCS(0); got != base+2 {
		t.Errorf("GOMAXPROCS %d after one shutdown, want %d", got, base+2)
	}
	b.close()
	if got := runtime.GOMAXPROCS(0); got != base {
		t.Errorf("GOMAXPROCS %d after both shut down, want %d", got, base)
	}
}

func TestCancellationIsVisible(t *testing.T) {
	var closed atomic.Int64
	register(&closed)
	m, err := startMock("", 1)
	if err != nil {
		t.Fatal(err)
	}
	m.post(1, "wait-cancel")
	time.Sleep(20 * time.Millisecond)
	m.cancel(1)
	m.waitDone(1, 5*time.Second)
	if _, r, _ := m.result(1); r != "saw cancel" {
		t.Errorf("got %q", r)
	}
	m.close()
}

func TestManyTasksAnsweredOnce(t *testing.T) {
	var closed atomic.Int64
	register(&closed)
	m, err := startMock("", 4)
	if err != nil {
		t.Fatal(err)
	}
	const n = 2000
	for i := 1; i <= n; i++ {
		m.post(i, fmt.Sprint("t", i))
	}
	if got := m.waitDone(n, 10*time.Second); got != n {
		t.Fatalf("answered %d of %d", got, n)
	}
	for i := 1; i <= n; i++ {
		s, r, c := m.result(i)
		if s != 0 || r != fmt.Sprint("echo:t", i) || c != 1 {
			t.Fatalf("task %d: (%d, %q, %d)", i, s, r, c)
		}
	}
	m.close()
}

func TestConfigAndConstructorErrors(t *testing.T) {
	var seen *Config
	Register(func(cfg *Config) (Handler, error) {
		seen = cfg
		if v, _ := cfg.Get("fail"); v == "yes" {
			return nil, errors.New("no database")
		}
		if v, _ := cfg.Get("fail"); v == "panic" {
			panic("ctor exploded")
		}
		return HandlerFunc(func(*Call) ([]byte, error) { return nil, nil }), nil
	})
	m, err := startMock("size=3 mode=fast", 3)
	if err != nil {
		t.Fatal(err)
	}
	m.close()
	if seen.Text != "size=3 mode=fast" || seen.Threads != 3 ||
		seen.Worker != 7 {
		t.Errorf("config %+v", seen)
	}
	if v, ok := seen.Get("mode"); v != "fast" || !ok {
		t.Errorf("Get(mode) = %q, %v", v, ok)
	}
	if _, ok := seen.Get("nope"); ok {
		t.Error("Get(nope) found something")
	}
	if _, err := startMock("fail=yes", 1); err == nil ||
		err.Error() != "failed to create handler: no database" {
		t.Errorf("err %v", err)
	}
	if _, err := startMock("fail=panic", 1); err == nil ||
		err.Error() != "failed to create handler: panic: ctor exploded" {
		t.Errorf("err %v", err)
	}
}
