{{/* Release-scoped base name: "gpu-topology" for a release of that name, "<release>-gpu-topology" otherwise. */}}
{{- define "gpu-topology.fullname" -}}
{{- if contains .Chart.Name .Release.Name -}}
{{- .Release.Name | trunc 40 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name .Chart.Name | trunc 40 | trimSuffix "-" -}}
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
  prioritizeVerb: prioritize
  preemptVerb: preempt
  bindVerb: bind
  weight: {{ $v.scheduler.weight }}
  nodeCacheCapable: {{ $v.scheduler.nodeCacheCapable }}
  enableHTTPS: {{ if .tls }}true{{ else }}false{{ end }}
  {{- with .tls }}
  tlsConfig:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  httpTimeout: {{ $v.scheduler.httpTimeout }}
  ignorable: {{ $v.scheduler.ignorable }}
  managedResources:
    - name: {{ $v.resourceName }}
      ignoredByScheduler: false
    {{- $domain := first (splitList "/" $v.resourceName) }}
    {{- range $v.scheduler.migResources }}
    - name: {{ $domain }}/{{ . }}
      ignoredByScheduler: false
    {{- end }}
    {{- range $v.scheduler.extraManagedResources }}
    - name: {{ . }}
      ignoredByScheduler: false
    {{- end }}
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
