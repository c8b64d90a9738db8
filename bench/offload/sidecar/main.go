// The "UNIX socket way" for the resty.loom.offload benchmark: an echo
// sidecar. Each message is a 4-byte big-endian length and that many bytes;
// the answer is the same frame. One goroutine per connection, buffered
// reads and writes (64 KiB).
package main

import (
	"bufio"
	"encoding/binary"
	"io"
	"log"
	"net"
	"os"
)

func serve(c net.Conn) {
	defer c.Close()
	r := bufio.NewReaderSize(c, 64*1024)
	w := bufio.NewWriterSize(c, 64*1024)
	var hdr [4]byte
	buf := make([]byte, 64*1024)
	for {
		if _, err := io.ReadFull(r, hdr[:]); err != nil {
			return
		}
		n := binary.BigEndian.Uint32(hdr[:])
		if int(n) > len(buf) {
			buf = make([]byte, n)
		}
		if _, err := io.ReadFull(r, buf[:n]); err != nil {
			return
		}
		w.Write(hdr[:])
		w.Write(buf[:n])
		if err := w.Flush(); err != nil {
			return
		}
	}
}

func main() {
	if len(os.Args) != 2 {
		log.Fatal("usage: sidecar <socket path>")
	}
	os.Remove(os.Args[1])
	l, err := net.Listen("unix", os.Args[1])
	if err != nil {
		log.Fatal(err)
	}
	for {
		c, err := l.Accept()
		if err != nil {
			log.Fatal(err)
		}
		go serve(c)
	}
}
