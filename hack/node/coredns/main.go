// Command coredns is CoreDNS v1.15 with only the plugins hack/node.sh's cluster DNS
// uses: the kubernetes plugin answers cluster.local and the reverse zones, and
// nothing forwards upstream (no packet may leave the machine), so the cloud and
// forwarding plugins of the stock build are left out, and with them most of its
// dependencies and build time.
package main

import (
	"github.com/coredns/coredns/core/dnsserver"
	"github.com/coredns/coredns/coremain"

	_ "github.com/coredns/coredns/plugin/bind"
	_ "github.com/coredns/coredns/plugin/cache"
	_ "github.com/coredns/coredns/plugin/errors"
	_ "github.com/coredns/coredns/plugin/health"
	_ "github.com/coredns/coredns/plugin/kubernetes"
	_ "github.com/coredns/coredns/plugin/ready"
)

// directives is the plugin chain's order, as in CoreDNS's plugin.cfg.
var directives = []string{"bind", "ready", "health", "errors", "cache", "kubernetes"}

func init() { dnsserver.Directives = directives }

func main() { coremain.Run() }
