// Prints, as JSON documents (YAML's marshaller there breaks some multi-line
// descriptions), the CustomResourceDefinitions CDI's operator installs, from
// the kubevirt.io/containerized-data-importer module itself (its own
// "crd-resources" factory), so the tests run on CDI's own schemas.
package main

import (
	"encoding/json"
	"fmt"
	"os"

	"kubevirt.io/containerized-data-importer/pkg/operator/resources/cluster"
)

func main() {
	objects, err := cluster.CreateStaticResourceGroup("crd-resources", &cluster.FactoryArgs{Namespace: "cdi"})
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(1)
	}
	for _, obj := range objects {
		if err := write(obj); err != nil {
			fmt.Fprintln(os.Stderr, err)
			os.Exit(1)
		}
	}
}

// write prints one object as a YAML document holding JSON.
func write(obj interface{}) error {
	b, err := json.Marshal(obj)
	if err != nil {
		return err
	}
	_, err = fmt.Printf("---\n%s\n", b)
	return err
}
