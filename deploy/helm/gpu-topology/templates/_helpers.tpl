{{/* The chart's name: nameOverride, else "gpu-topology". */}}
{{- define "gpu-topology.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 40 | trimSuffix "-" -}}
{{- end -}}

{{/* Release-scoped base name of every object: fullnameOverride, else "<release>" when the release name contains the
     chart's name (a release called gpu-topology gives "gpu-topology"), else "<release>-<name>". Cut at 40 characters,
     not Helm's usual 63: objects append up to 23 (-scheduler-metrics, -extender-metrics, -mps-control), and a
     Service name or label value may not exceed 63. */}}
{{- define "gpu-topology.fullname" -}}
{{- if .Values.fullnameOverride -}}
{{- .Values.fullnameOverride | trunc 40 | trimSuffix "-" -}}
{{- else -}}
{{- $name := include "gpu-topology.name" . -}}
{{- if contains $name .Release.Name -}}
{{- .Release.Name | trunc 40 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name $name | trunc 40 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{- define "gpu-topology.labels" -}}
app.kubernetes.io/part-of: gpu-topology
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version }}
{{- end -}}

{{/* Selector labels of one component: call with (dict "ctx" $ "name" "plugin"). */}}
{{- define "gpu-topology.selectorLabels" -}}
app.kubernetes.io/name: {{ include "gpu-topology.fullname" .ctx }}-{{ .name }}
app.kubernetes.io/instance: {{ .ctx.Release.Name }}
{{- end -}}

{{/* Where every namespaced object goes: namespace.name, else the release namespace. */}}
{{- define "gpu-topology.namespace" -}}
{{- default .Release.Namespace .Values.namespace.name -}}
{{- end -}}

{{/* A component's image, called with (list . "plugin") or (list . "extender"): the plugin's runs the device plugin
     and the DRA driver, the extender's the extender and the webhook. Tag: the component's, else image.tag, else the
     chart's appVersion. */}}
{{- define "gpu-topology.image" -}}
{{- $root := index . 0 -}}
{{- $image := index $root.Values (index . 1) "image" -}}
{{- printf "%s:%s" $image.repository (default (default $root.Chart.AppVersion $root.Values.image.tag) $image.tag) -}}
{{- end -}}

{{/* kube-scheduler's image: the tag given, else the cluster's own version (vMAJOR.MINOR.PATCH of the API server, with
     a provider suffix such as -eks-... dropped), since kube-scheduler must not be newer than kube-apiserver. */}}
{{- define "gpu-topology.schedulerImage" -}}
{{- $tag := .Values.scheduler.image.tag -}}
{{- if not $tag -}}
{{- $v := semver .Capabilities.KubeVersion.Version -}}
{{- $tag = printf "v%d.%d.%d" $v.Major $v.Minor $v.Patch -}}
{{- end -}}
{{- printf "%s:%s" .Values.scheduler.image.repository $tag -}}
{{- end -}}

{{/* A pod template's labels: the chart's and the component's, plus the user's podLabels, which may not replace
     them (the selector depends on them). (dict "ctx" $ "name" "plugin" "component" "device-plugin" "extra" map) */}}
{{- define "gpu-topology.podLabels" -}}
{{- $own := merge (fromYaml (include "gpu-topology.labels" .ctx)) (fromYaml (include "gpu-topology.selectorLabels" .)) (dict "app.kubernetes.io/component" .component) -}}
{{- range $key, $_ := .extra }}
{{- if hasKey $own $key }}
{{- fail (printf "podLabels may not set %s: the chart sets it (selectors depend on it)" $key) }}
{{- end }}
{{- end }}
{{- toYaml (merge (dict) $own .extra) -}}
{{- end -}}

{{/* imagePullSecrets of every pod. */}}
{{- define "gpu-topology.imagePullSecrets" -}}
{{- with .Values.imagePullSecrets }}
imagePullSecrets:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- end -}}

{{- define "gpu-topology.leaseName" -}}
{{- default .Values.scheduler.schedulerName .Values.scheduler.leaderElection.resourceName -}}
{{- end -}}

{{/* The extender entry of a KubeSchedulerConfiguration; (dict "ctx" $ "url" ... "tls" <tlsConfig or nil>). */}}
{{- define "gpu-topology.extenderEntry" -}}
{{- $v := .ctx.Values -}}
- urlPrefix: {{ .url }}
  filterVerb: filter
  {{- if $v.scheduler.filterBest }}
  # filter passes only the nodes of the best placement (gpu-extender --filter-best): one call per pod, and
  # kube-scheduler's own scores choose among them.
  {{- else }}
  prioritizeVerb: prioritize
  weight: {{ $v.scheduler.weight }}
  {{- end }}
  preemptVerb: preempt
  bindVerb: bind
  nodeCacheCapable: {{ $v.scheduler.nodeCacheCapable }}
  enableHTTPS: {{ if .tls }}true{{ else }}false{{ end }}
  {{- with .tls }}
  tlsConfig:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  httpTimeout: {{ $v.scheduler.httpTimeout }}
  ignorable: {{ $v.scheduler.ignorable }}
  {{- if $v.webhook.wholeJobs }}
  # No managedResources: kube-scheduler then asks the extender about every pod of this scheduler, which only gets
  # the pods sent to it: GPU pods, and (webhook.wholeJobs) the pods of a Kubeflow job that ask no GPU, such as a
  # TFJob's parameter servers, which no resource list can name.
  {{- else }}
  # kube-scheduler asks the extender only about pods naming one of these in their requests or limits (exact names).
  managedResources:
    {{- range (include "gpu-topology.managedResourceNames" .ctx | fromJsonArray) }}
    - name: {{ . }}
      ignoredByScheduler: false
    {{- end }}
  {{- end }}
{{- end -}}

{{/* The second extender entry, with dra.enabled: the same extender, asked about every pod of the scheduler (no
     managedResources: a pod whose GPUs come through resource claims names no extended resource, and kube-scheduler
     asks an extender listing resources only about pods naming one), so that DRA nodes are ranked by the best free
     GPU set (extender.placement.dra). It never binds or preempts, and is ignorable: while the extender is away such
     pods are placed as kube-scheduler alone would. Pods without GPU claims are answered at once (filter passes
     every node, prioritize scores 0). */}}
{{- define "gpu-topology.draExtenderEntry" -}}
{{- $v := .ctx.Values -}}
- urlPrefix: {{ .url }}
  filterVerb: filter
  {{- if not $v.scheduler.filterBest }}
  prioritizeVerb: prioritize
  weight: {{ $v.scheduler.weight }}
  {{- end }}
  nodeCacheCapable: {{ $v.scheduler.nodeCacheCapable }}
  enableHTTPS: {{ if .tls }}true{{ else }}false{{ end }}
  {{- with .tls }}
  tlsConfig:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  httpTimeout: {{ $v.scheduler.httpTimeout }}
  ignorable: true
{{- end -}}

{{/* Every extended resource name a GPU pod may ask, as a JSON list, each once, in this order: resourceName, the MIG
     names (scheduler.migResources under resourceName's domain), the shared name NVIDIA's renameByDefault gives each
     of them (<name>.shared), then the names of sharing configs (gpu-topology.sharingResourceNames) and
     scheduler.extraManagedResources. kube-scheduler matches managedResources by exact name, so a name left out here
     is a pod the extender never sees. */}}
{{- define "gpu-topology.managedResourceNames" -}}
{{- $v := .Values -}}
{{- $domain := first (splitList "/" $v.resourceName) -}}
{{- $names := list $v.resourceName -}}
{{- range $v.scheduler.migResources }}{{ $names = append $names (printf "%s/%s" $domain .) }}{{ end -}}
{{- $names = append $names (printf "%s.shared" $v.resourceName) -}}
{{- range $v.scheduler.migResources }}{{ $names = append $names (printf "%s/%s.shared" $domain .) }}{{ end -}}
{{- $names = concat $names (include "gpu-topology.sharingResourceNames" . | fromJsonArray) $v.scheduler.extraManagedResources -}}
{{- toJson (uniq $names) -}}
{{- end -}}

{{/* The managed names the webhook does not know by rule (resourceName, <resourceName>.shared and the MIG names of
     its domain, shared ones included), as a JSON list: its --extra-resources. */}}
{{- define "gpu-topology.webhookExtraResources" -}}
{{- $v := .Values -}}
{{- $mig := printf "%s/mig-" (first (splitList "/" $v.resourceName)) -}}
{{- $out := list -}}
{{- range (include "gpu-topology.managedResourceNames" . | fromJsonArray) -}}
{{- if not (or (eq . $v.resourceName) (eq . (printf "%s.shared" $v.resourceName)) (hasPrefix $mig .)) -}}
{{- $out = append $out . -}}
{{- end -}}
{{- end -}}
{{- toJson $out -}}
{{- end -}}

{{/* The resource names GPU sharing configs advertise, as a JSON list: for each resource of each config in
     plugin.sharing.configs (sharing.timeSlicing and sharing.mps), its `rename`, else <name>.shared under
     renameByDefault, else its own name; then plugin.sharing.resourceNames (configs the chart does not hold:
     plugin.sharing.configMapName, a GPU Operator's). A config that is not YAML fails the render, naming it. */}}
{{- define "gpu-topology.sharingResourceNames" -}}
{{- $s := .Values.plugin.sharing -}}
{{- $names := list -}}
{{- range $config, $text := $s.configs -}}
{{- $doc := fromYaml $text -}}
{{- if hasKey $doc "Error" -}}
{{- fail (printf "plugin.sharing.configs.%s is not YAML: %s" $config (get $doc "Error")) -}}
{{- end -}}
{{- $sharing := get $doc "sharing" -}}
{{- if kindIs "map" $sharing -}}
{{- range $strategy := list "timeSlicing" "mps" -}}
{{- $section := get $sharing $strategy -}}
{{- if kindIs "map" $section -}}
{{- $resources := get $section "resources" -}}
{{- if kindIs "slice" $resources -}}
{{- range $resources -}}
{{- if and (kindIs "map" .) (kindIs "string" (get . "name")) -}}
{{- $rename := get . "rename" -}}
{{- if and (kindIs "string" $rename) $rename -}}
{{- $names = append $names $rename -}}
{{- else if get $section "renameByDefault" -}}
{{- $names = append $names (printf "%s.shared" (get . "name")) -}}
{{- else -}}
{{- $names = append $names (get . "name") -}}
{{- end -}}
{{- end -}}
{{- end -}}
{{- end -}}
{{- end -}}
{{- end -}}
{{- end -}}
{{- end -}}
{{- toJson (uniq (concat $names (default list $s.resourceNames))) -}}
{{- end -}}

{{/* Arguments shared by every extender container. */}}
{{- define "gpu-topology.extenderArgs" -}}
- --resource-name={{ .Values.resourceName }}
- --annotation-prefix={{ .Values.annotationPrefix }}
- --reservation-timeout={{ .Values.extender.reservationTimeout }}
- --island-penalty={{ .Values.extender.islandPenalty }}
- --island-spare={{ .Values.extender.islandSpare }}
{{- with .Values.extender.locality }}
- --locality={{ . }}
{{- end }}
- --job-owner-kinds={{ join "," .Values.extender.jobOwnerKinds }}
{{- if .Values.scheduler.filterBest }}
- --filter-best
{{- end }}
{{- range .Values.extender.extraArgs }}
- {{ . }}
{{- end }}
{{- end -}}

{{/* The extender container's extra environment variables (extender.extraEnv), if any. */}}
{{- define "gpu-topology.extenderEnv" -}}
{{- with .Values.extender.extraEnv }}
env:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- end -}}

{{- define "gpu-topology.metricsFrom" -}}
{{- with .Values.networkPolicy.metricsFrom }}
from:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- end -}}

{{/* The extender's list + watch rules for the job owner kinds chosen (extender.jobOwnerKinds), one per API group,
only the groups of those kinds: deploy/rbac-calls.yaml lists them all. */}}
{{- define "gpu-topology.jobOwnerRules" -}}
{{- $groups := dict "PyTorchJob" "kubeflow.org" "TFJob" "kubeflow.org" "XGBoostJob" "kubeflow.org" "PaddleJob" "kubeflow.org" "JAXJob" "kubeflow.org" "MPIJob" "kubeflow.org" "TrainJob" "trainer.kubeflow.org" "JobSet" "jobset.x-k8s.io" "LeaderWorkerSet" "leaderworkerset.x-k8s.io" }}
{{- $plurals := dict "PyTorchJob" "pytorchjobs" "TFJob" "tfjobs" "XGBoostJob" "xgboostjobs" "PaddleJob" "paddlejobs" "JAXJob" "jaxjobs" "MPIJob" "mpijobs" "TrainJob" "trainjobs" "JobSet" "jobsets" "LeaderWorkerSet" "leaderworkersets" }}
{{- range $group := list "kubeflow.org" "trainer.kubeflow.org" "jobset.x-k8s.io" "leaderworkerset.x-k8s.io" }}
{{- $resources := list }}
{{- range $kind := $.Values.extender.jobOwnerKinds }}
{{- if eq (get $groups $kind) $group }}
{{- $resources = append $resources (get $plurals $kind) }}
{{- end }}
{{- end }}
{{- if $resources }}
  # list + watch: job sizes from the objects that own the pods ({{ $group }}; extender.jobOwnerKinds).
  - apiGroups: [{{ $group | quote }}]
    resources: {{ toJson $resources }}
    verbs: ["list", "watch"]
{{- end }}
{{- end }}
{{- end -}}


{{/* A securityContext: the chart's hardened defaults (YAML text) with the user's override merged over them, maps one
     level deep (capabilities: {add: [...]} keeps drop: [ALL]), anything else replaced; a key set to null is left
     out. (dict "defaults" "<yaml>" "override" map) */}}
{{- define "gpu-topology.securityContext" -}}
{{- $out := fromYaml .defaults -}}
{{- range $key, $value := .override -}}
{{- $current := get $out $key -}}
{{- if and (kindIs "map" $value) (kindIs "map" $current) -}}
{{- $merged := deepCopy $current -}}
{{- range $k, $v := $value -}}
{{- $_ := set $merged $k $v -}}
{{- end -}}
{{- $_ := set $out $key $merged -}}
{{- else if kindIs "invalid" $value -}}
{{- $_ := unset $out $key -}}
{{- else -}}
{{- $_ := set $out $key $value -}}
{{- end -}}
{{- end -}}
{{- toYaml $out -}}
{{- end -}}

{{/* The node affinity of the plugin's DaemonSets (device plugin, MPS control). The chart's own conditions:
     - plugin.optIn (default): only nodes labelled <annotationPrefix>/device-plugin=enabled; else every GPU node
       (nvidia.com/gpu.present=true or feature.node.kubernetes.io/pci-10de.present=true) not labelled
       <annotationPrefix>/device-plugin=nvidia;
     - in both: never a node where the GPU Operator deploys its own device plugin
       (nvidia.com/gpu.deploy.device-plugin=true; NotIn also matches nodes without the label);
     - with dra.enabled: not the DRA nodes (<annotationPrefix>/gpu-mode=<dra.nodeLabelValue>).
     plugin.affinity is kept, and these conditions are added to each of its required nodeSelectorTerms; with none,
     they are the terms. */}}
{{- define "gpu-topology.pluginAffinity" -}}
{{- $v := .Values -}}
{{- $label := printf "%s/device-plugin" $v.annotationPrefix -}}
{{- $own := list -}}
{{- if $v.plugin.optIn -}}
{{- $own = append $own (dict "key" $label "operator" "In" "values" (list "enabled")) -}}
{{- else -}}
{{- $own = append $own (dict "key" $label "operator" "NotIn" "values" (list "nvidia")) -}}
{{- end -}}
{{- $own = append $own (dict "key" "nvidia.com/gpu.deploy.device-plugin" "operator" "NotIn" "values" (list "true")) -}}
{{- if $v.dra.enabled -}}
{{- $own = append $own (dict "key" (printf "%s/gpu-mode" $v.annotationPrefix) "operator" "NotIn" "values" (list $v.dra.nodeLabelValue)) -}}
{{- end -}}
{{- $affinity := deepCopy (default (dict) $v.plugin.affinity) -}}
{{- $node := default (dict) $affinity.nodeAffinity -}}
{{- $required := default (dict) (get $node "requiredDuringSchedulingIgnoredDuringExecution") -}}
{{- $terms := list -}}
{{- range (default (list) $required.nodeSelectorTerms) -}}
{{- $terms = append $terms (set (deepCopy .) "matchExpressions" (concat (default (list) .matchExpressions) $own)) -}}
{{- end -}}
{{- if not $terms -}}
{{- if $v.plugin.optIn -}}
{{- $terms = list (dict "matchExpressions" $own) -}}
{{- else -}}
{{- range list "nvidia.com/gpu.present" "feature.node.kubernetes.io/pci-10de.present" -}}
{{- $terms = append $terms (dict "matchExpressions" (prepend $own (dict "key" . "operator" "In" "values" (list "true")))) -}}
{{- end -}}
{{- end -}}
{{- end -}}
{{- $_ := set $required "nodeSelectorTerms" $terms -}}
{{- $_ := set $node "requiredDuringSchedulingIgnoredDuringExecution" $required -}}
{{- $_ := set $affinity "nodeAffinity" $node -}}
{{- toYaml $affinity -}}
{{- end -}}

{{/* The standalone extender's leader-election Lease (default-scheduler mode). */}}
{{- define "gpu-topology.extenderLeaseName" -}}
{{- default (printf "%s-extender" (include "gpu-topology.fullname" .)) .Values.standaloneExtender.leaderElection.leaseName -}}
{{- end -}}

{{/* The node agents' container securityContext defaults (plugin, MPS control, DRA driver): uid 0 with every
     capability dropped, no privilege, a read-only root. */}}
{{- define "gpu-topology.rootNodeAgentSecurityContext" -}}
runAsUser: 0
runAsGroup: 0
runAsNonRoot: false
privileged: false
allowPrivilegeEscalation: false
readOnlyRootFilesystem: true
capabilities:
  drop: ["ALL"]
{{- end -}}

{{/* The other containers' securityContext defaults (extender, webhook, kube-scheduler). */}}
{{- define "gpu-topology.nonRootContainerSecurityContext" -}}
runAsNonRoot: true
privileged: false
allowPrivilegeEscalation: false
readOnlyRootFilesystem: true
capabilities:
  drop: ["ALL"]
{{- end -}}

{{/* The pod securityContext defaults of the extender's image (standalone extender, webhook): fsGroup, so the
     non-root process can read its TLS Secret's files (mode 0440). */}}
{{- define "gpu-topology.extenderPodSecurityContext" -}}
runAsNonRoot: true
runAsUser: 10001
runAsGroup: 10001
fsGroup: 10001
seccompProfile:
  type: RuntimeDefault
{{- end -}}


{{/* A DaemonSet's updateStrategy from its value: rollingUpdate only with type RollingUpdate (Helm merges the chart's
     default rollingUpdate into a user's {type: OnDelete}, which the API server would reject). */}}
{{- define "gpu-topology.updateStrategy" -}}
type: {{ .type }}
{{- if and (eq .type "RollingUpdate") .rollingUpdate }}
rollingUpdate:
  {{- toYaml .rollingUpdate | nindent 2 }}
{{- end }}
{{- end -}}
