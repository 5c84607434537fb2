// Validates custom resources against the schemas that the npm packages @kubernetes-models/gateway-api and
// @kubernetes-models/prometheus-operator generate from those projects' CRDs (`make test` installs them).
// Usage: node crd_schemas.mjs NODE_MODULES_DIR < documents.json   (a JSON array of manifests)
// Prints one line per document ("ok KIND/NAME", "FAIL KIND/NAME: why", "none KIND/NAME"); exits 1 on a FAIL.
import { readFileSync } from "node:fs";
import { join } from "node:path";
import { pathToFileURL } from "node:url";

const modules = process.argv[2];
const models = {
  "gateway.networking.k8s.io/v1": "@kubernetes-models/gateway-api/gateway.networking.k8s.io/v1",
  "monitoring.coreos.com/v1": "@kubernetes-models/prometheus-operator/monitoring.coreos.com/v1",
};
let failed = 0;
for (const doc of JSON.parse(readFileSync(0, "utf8"))) {
  const name = `${doc.kind}/${doc.metadata?.name}`;
  const dir = models[doc.apiVersion];
  if (!dir) {
    console.log(`none ${name}`);
    continue;
  }
  const module = await import(pathToFileURL(join(modules, dir, `${doc.kind}.js`)).href);
  try {
    new module[doc.kind](doc).validate();
    console.log(`ok ${name}`);
  } catch (error) {
    failed += 1;
    console.log(`FAIL ${name}: ${error.message}`);
  }
}
process.exit(failed ? 1 : 0);
